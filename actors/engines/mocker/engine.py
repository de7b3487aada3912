"""MockerEngine: a simulated vLLM behind the Engine protocol (see ``config.py`` for its args).

One asyncio task per DP rank (``ranks.py``) runs scheduler steps: each step schedules
(``scheduler.py``), waits the timing model's duration (``timing.py``; no sleep at all at zero
compute, only a yield), records a ``StepSample`` of it (``take_steps``), then publishes the step's
KV events as one ZMQ batch (``kv_events.py``) and delivers the step's tokens. Loaded LoRA adapters are kept in ``loras.py``. This module is the
engine's face: request admission and streaming, lifecycle, sleep, faults.

Roles: "prefill" forces ``max_tokens=1`` and puts NIXL-like ``kv_transfer_params`` on the final
output; "decode" publishes no KV events and, given ``kv_transfer_params`` with
``do_remote_prefill``, treats all prompt tokens but the last as already computed (the simulated
hand-off) and reports them as cached. Faults: ``die_at_start``, ``die_after_tokens``,
``hang_after_tokens`` args, and ``inject_death()`` / ``inject_hang()`` at any time.

Image prompts (``input_modalities`` with "image"): ``TokensPrompt.token_ids`` is the expanded prompt,
so the images' placeholder tokens are prompt tokens like any; the images only key the blocks they
touch (``actors.engines.mm_keys``: the same text with another image is a prefix-cache miss from the
first block holding it) and appear in the ``BlockStored`` extra keys exactly as vLLM's.

With a ``tokenizer`` arg (``text_codec.py``) text is real text, and a ``script`` (``script.py``)
replaces the pseudo-tokens of matching prompts by given text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from actors.engines.limits import Limits, check_prompt_ids, check_sampling_limits
from actors.engines.mm_keys import MmSpan, mm_spans
from actors.engines.mocker import outputs
from actors.engines.mocker import tokens as tk
from actors.engines.mocker.config import MockerArgs
from actors.engines.mocker.embedding import check_dimensions, embedding
from actors.engines.mocker.loras import LoadedLoras
from actors.engines.mocker.ranks import Rank, Sink, build_ranks
from actors.engines.mocker.scheduler import MockRequest, StepResult
from actors.engines.mocker.script import Script
from actors.engines.mocker.text_codec import IncrementalDetokenizer, TextCodec
from actors.engines.mocker.timing import TimingModel
from actors.engines.protocol import (
    EmbedsPrompt,
    EncodeFailed,
    Engine,
    EngineDeadError,
    EngineOutput,
    EngineStats,
    KvEventSource,
    LoraRef,
    ModelFacts,
    Prompt,
    Role,
    SamplingOptions,
    StepSample,
    TextPrompt,
    TokensPrompt,
)
from bus.errors import BadRequest

logger = logging.getLogger(__name__)


async def _first(*events: asyncio.Event) -> None:
    """Returns once any of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class MockerEngine(Engine):
    def __init__(self, args: dict[str, Any] | None = None, role: Role = "agg",
                 served_model_name: str = "mock", kv_events_port: int | None = None,
                 seed: int = 0) -> None:
        if role not in ("agg", "prefill", "decode", "embed"):
            raise ValueError(f"unknown role {role!r}")
        self.args = MockerArgs.from_dict(args)
        self.role = role
        self.seed = seed
        self.engine_id = f"mocker-{uuid.uuid4().hex[:12]}"
        self.kv_events_port = kv_events_port or 0
        a = self.args
        self.facts = ModelFacts(
            served_model_name=served_model_name, model_path="mock", tokenizer_path="mock",
            max_model_len=a.max_model_len, block_size=a.block_size, total_kv_blocks=a.num_gpu_blocks,
            dp_size=a.dp_size, vocab_size=a.vocab_size, eos_token_ids=[a.eos_token_id],
            max_logprobs=a.max_logprobs, input_modalities=list(a.input_modalities),
            embedding_size=a.embedding_size if role == "embed" else None, is_matryoshka=a.is_matryoshka,
            matryoshka_dimensions=list(a.matryoshka_dimensions) if a.matryoshka_dimensions else None)
        self.limits = Limits.of(self.facts)
        self.timing = TimingModel(a.speedup_ratio)
        self.received_kv_transfer_params: list[dict[str, Any]] = []
        self.tokens_generated = 0
        self._dead = asyncio.Event()
        self._awake = asyncio.Event()
        self._awake.set()
        self._hung = False
        self._hang_fired = False
        self._unhang = asyncio.Event()
        self._ranks: list[Rank] = []
        self._loras = LoadedLoras(a.lora_capacity, self.engine_id)
        self._codec = TextCodec(a.tokenizer) if a.tokenizer is not None else None
        self._script = Script(a.script, self._codec, a.vocab_size) \
            if a.script and self._codec is not None else None
        self._started = False
        self._stopped = False
        self._embeds: dict[str, asyncio.Event] = {}  # embedding requests in flight -> their abort

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        if self.args.die_at_start:
            self._die("die_at_start injected")
            raise EngineDeadError("mocker engine died at start (die_at_start)")
        a = self.args
        self._ranks = build_ranks(a, self.role, self.kv_events_port, self._sample)
        for rank in self._ranks:
            rank.task = asyncio.get_running_loop().create_task(
                self._loop(rank), name=f"mocker-{self.engine_id}-dp{rank.dp_rank}")
        self._started = True
        logger.info("mocker %s started: role=%s dp=%d blocks=%d x %d speedup=%s", self.engine_id,
                    self.role, a.dp_size, a.num_gpu_blocks, a.block_size, a.speedup_ratio)

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        tasks = [r.task for r in self._ranks if r.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for rank in self._ranks:
            for req in list(rank.sched.requests.values()):
                rank.sched.finish(req, "abort")
                self._push(req, self._output(req, [], final=True))
            rank.close_publisher()

    # --- the simulation loop -------------------------------------------------------------------
    async def _loop(self, rank: Rank) -> None:
        sched = rank.sched
        try:
            while not self._dead.is_set():
                if not self._awake.is_set():
                    await self._awake.wait()
                    continue
                if self._hung:
                    await self._unhang.wait()
                    await asyncio.sleep(0)
                    continue
                if not sched.has_work():
                    rank.flush_events()
                    rank.work.clear()
                    await rank.work.wait()
                    continue
                t0 = time.perf_counter()
                res = sched.step()
                kv_blocks = rank.blocks_in_step(res)  # a finished request's KV was read too
                delay = self.timing.step_seconds(res.prefill_tokens, res.num_decode,
                                                 kv_blocks, rank.pool.num_blocks)
                await asyncio.sleep(delay)  # sleep(0) is a bare yield: zero compute means no delay
                if self._dead.is_set():
                    return
                rank.record_step(res, kv_blocks, time.perf_counter() - t0)
                rank.flush_events()
                self._deliver(rank, res)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in the simulation is an engine death, not a silent hang
            logger.exception("mocker %s rank %d crashed", self.engine_id, rank.dp_rank)
            self._die(f"simulation error: {e!r}")

    def _deliver(self, rank: Rank, res: StepResult) -> None:
        a = self.args
        for req, tok in res.sampled:
            if req.finish_reason == "abort":
                continue
            if self._hung or self._dead.is_set():
                return
            self._push(req, self._output(req, [tok], final=req.finished))
            self.tokens_generated += 1
            if a.die_after_tokens is not None and self.tokens_generated >= a.die_after_tokens:
                self._die(f"die_after_tokens={a.die_after_tokens} reached")
                return
            if (a.hang_after_tokens is not None and not self._hang_fired
                    and self.tokens_generated >= a.hang_after_tokens):
                logger.warning("mocker %s hangs (hang_after_tokens=%d)", self.engine_id,
                               a.hang_after_tokens)
                self._hang_fired = True
                self.inject_hang()
                return

    def _sample(self, req: MockRequest) -> int:
        if req.script is not None:  # a scripted reply: its next token, then EOS
            i = len(req.output)
            return req.script[i] if i < len(req.script) else self.args.eos_token_id
        n = req.num_tokens
        tail = (req.prompt[-tk.HISTORY:] + req.output)[-tk.HISTORY:] if len(req.output) < tk.HISTORY \
            else req.output[-tk.HISTORY:]
        banned: set[int] = set()
        if len(req.output) < req.min_tokens:
            banned = set(req.stop_token_ids)
            if req.eos_token_id is not None:
                banned.add(req.eos_token_id)
        attempt = 0
        while True:
            tok = tk.token_after(tail, n, self.args.vocab_size, req.token_seed, attempt)
            if tok not in banned or len(banned) >= self.args.vocab_size:
                return tok
            attempt += 1

    def _output(self, req: MockRequest, toks: list[int], final: bool) -> EngineOutput:
        return outputs.build(req, toks, final, role=self.role, engine_id=self.engine_id,
                             vocab_size=self.args.vocab_size)

    @staticmethod
    def _push(req: MockRequest, item: EngineOutput | BaseException) -> None:
        if req.sink is not None:
            req.sink.queue.put_nowait(item)

    def _die(self, reason: str) -> None:
        if self._dead.is_set():
            return
        logger.error("mocker %s died: %s", self.engine_id, reason)
        self._dead.set()
        self._awake.set()
        self._unhang.set()
        current = asyncio.current_task() if self._started else None
        for rank in self._ranks:
            for req in list(rank.sched.requests.values()):
                self._push(req, EngineDeadError(f"mocker engine died: {reason}"))
            if rank.task is not None and rank.task is not current:
                rank.task.cancel()
            rank.close_publisher()  # like vLLM: the publisher dies with EngineCore

    # --- requests ----------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TokensPrompt):
            ids = list(prompt.token_ids)
            check_prompt_ids(ids, self.limits)
            return ids
        if isinstance(prompt, TextPrompt):
            if self._codec is not None:  # as vLLM tokenizes a text prompt (BOS and all)
                return self._codec.encode(prompt.text, add_special_tokens=True)
            return tk.tokenize_text(prompt.text)
        if isinstance(prompt, EmbedsPrompt):
            return tk.embeds_token_ids(prompt.tensor, self.args.vocab_size, prompt.num_tokens)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def _mm_spans(self, prompt: Prompt, n_tokens: int) -> tuple[MmSpan, ...]:
        """The images of a token prompt (``token_ids`` already expanded: they count as its tokens),
        checked as vLLM's processor would refuse them (ValueErrors)."""
        mm = prompt.mm if isinstance(prompt, TokensPrompt) else None
        if mm is None:
            return ()
        if "image" not in self.args.input_modalities:
            raise ValueError("this model does not take images (mocker arg input_modalities)")
        if len(mm.placeholders) != len(mm.images):
            raise ValueError(f"{len(mm.images)} images but {len(mm.placeholders)} placeholder ranges")
        end = min(mm.prompt_len, n_tokens)
        prev = 0
        for off, n in mm.placeholders:
            if off < prev or n <= 0 or off + n > end:
                raise ValueError(f"image placeholder range ({off}, {n}) is not in order within the "
                                 f"{end}-token prompt")
            prev = off + n
        return tuple(mm_spans(mm) or ())

    def _scripted_reply(self, prompt: Prompt, ids: list[int]) -> list[int] | None:
        """The script's reply for this prompt (None: no script, no match, or embeddings)."""
        if self._script is None or isinstance(prompt, EmbedsPrompt):
            return None
        text = prompt.text if isinstance(prompt, TextPrompt) \
            else self._script.codec.decode(ids, skip_special_tokens=False)
        return self._script.reply(text, ids)

    def _sink(self, sampling: SamplingOptions) -> Sink:
        detok = None
        if self._codec is not None and sampling.detokenize:
            detok = IncrementalDetokenizer(self._codec, bool(sampling.extra.get("skip_special_tokens", True)))
        return Sink(sampling, detok)

    def _pick_rank(self) -> Rank:
        return min(self._ranks, key=lambda r: (r.sched.load, r.dp_rank))

    async def generate(self, prompt: Prompt, sampling: SamplingOptions, request_id: str,
                       lora: LoraRef | None = None,
                       kv_transfer_params: dict[str, Any] | None = None,
                       trace_headers: Mapping[str, str] | None = None) -> AsyncIterator[EngineOutput]:
        """Async generator of delta outputs (validation errors surface on the first iteration)."""
        if self._dead.is_set():
            raise EngineDeadError("mocker engine is dead")
        if not self._started or self._stopped:
            raise RuntimeError("mocker engine is not running")
        # vLLM's request checks (ValueErrors, as vLLM's are), before anything is built for the
        # request: logprobs once made one list entry per requested logprob, however many
        check_sampling_limits(sampling, self.limits)
        ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("empty prompt")
        mm = self._mm_spans(prompt, len(ids))
        if self.args.poison_token_id is not None and self.args.poison_token_id in ids:
            # a request of death: the whole worker process goes, with no chance to answer
            logger.error("mocker %s: request %s holds poison_token_id %d; killing this process",
                         self.engine_id, request_id, self.args.poison_token_id)
            os.kill(os.getpid(), signal.SIGKILL)
        if len(ids) >= self.args.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.args.max_model_len}")
        if lora is not None:
            if not self.args.enable_lora:
                raise ValueError(f"LoRA {lora.name!r} requested but enable_lora is off")
            await self.add_lora(lora)  # loaded on demand, like vLLM
        remote = 0
        if kv_transfer_params is not None:
            self.received_kv_transfer_params.append(dict(kv_transfer_params))
            if self.role != "prefill" and kv_transfer_params.get("do_remote_prefill"):
                remote = len(ids) - 1
        max_tokens = 1 if self.role == "prefill" else sampling.max_tokens
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        rank = self._pick_rank()
        if request_id in rank.sched.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        lora_name = lora.name if lora else None
        reply = self._scripted_reply(prompt, ids)
        # a scripted reply ends with EOS whatever ignore_eos/min_tokens say: the script is the output
        req = MockRequest(
            request_id=request_id, prompt=ids, max_tokens=max_tokens,
            min_tokens=sampling.min_tokens if reply is None else 0,
            eos_token_id=None if sampling.ignore_eos and reply is None else self.args.eos_token_id,
            stop_token_ids=frozenset(sampling.stop_token_ids), lora_name=lora_name,
            lora_id=lora.int_id if lora else None, request_seed=sampling.seed,
            remote_prefill_tokens=remote,
            token_seed=tk.hash_seed(self.seed, lora_name, sampling.seed), script=reply, mm=mm,
            sink=self._sink(sampling))
        rank.sched.add(req)
        rank.work.set()
        queue = req.sink.queue
        try:
            error: BaseException | None = None
            while error is None:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                while not queue.empty() and not item.finish_reason:
                    nxt = queue.get_nowait()  # a slow consumer gets merged deltas, like vLLM
                    if isinstance(nxt, BaseException):
                        error = nxt  # deliver the tokens that made it, then fail
                        break
                    item = outputs.merge(item, nxt)
                yield item
                if item.finish_reason is not None:
                    return
            raise error
        finally:
            if not req.finished and not self._dead.is_set():
                rank.sched.finish(req, "abort")  # the consumer went away

    async def embed(self, token_ids: list[int], request_id: str, *, dimensions: int | None = None,
                    use_activation: bool | None = None) -> bytes:
        """Role "embed": a deterministic embedding of the prompt (the same ids and seed give the
        same vector, as a pooling model does), after the timing model's prefill time for it. Faults
        as for generate: ``poison_token_id`` kills the process, a death raises EngineDeadError, a
        hang or sleep holds it, an abort ends it with EncodeFailed."""
        if self.role != "embed":
            raise BadRequest("this worker is not an embedding worker")
        if self._dead.is_set():
            raise EngineDeadError("mocker engine is dead")
        if not self._started or self._stopped:
            raise RuntimeError("mocker engine is not running")
        check_prompt_ids(token_ids, self.limits)
        if not token_ids:
            raise ValueError("empty prompt")
        if len(token_ids) > self.args.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.args.max_model_len}")
        size = check_dimensions(self.args, self.facts.served_model_name, dimensions)
        if self.args.poison_token_id is not None and self.args.poison_token_id in token_ids:
            logger.error("mocker %s: request %s holds poison_token_id %d; killing this process",
                         self.engine_id, request_id, self.args.poison_token_id)
            os.kill(os.getpid(), signal.SIGKILL)
        if request_id in self._embeds:
            raise ValueError(f"duplicate request id {request_id!r}")
        aborted = self._embeds[request_id] = asyncio.Event()
        try:
            await self._embed_wait(self.timing.step_seconds(len(token_ids), 0, 0, 1), aborted)
        finally:
            self._embeds.pop(request_id, None)
        if self._dead.is_set():
            raise EngineDeadError("mocker engine died")
        if aborted.is_set():
            raise EncodeFailed(f"embedding {request_id} aborted")
        return embedding(token_ids, self.seed, self.args.embedding_size, size, use_activation is not False)

    async def _embed_wait(self, seconds: float, aborted: asyncio.Event) -> None:
        """The embedding's compute time, held while asleep or hung; ends early on death or abort."""
        stop = asyncio.ensure_future(_first(self._dead, aborted))
        try:
            while not stop.done():
                if not self._awake.is_set() or self._hung:
                    gate = self._awake if not self._awake.is_set() else self._unhang
                    await asyncio.wait({stop, asyncio.ensure_future(gate.wait())},
                                       return_when=asyncio.FIRST_COMPLETED)
                    continue
                if seconds > 0:
                    await asyncio.wait({stop}, timeout=seconds)
                else:
                    await asyncio.sleep(0)  # zero compute: a bare yield, as a mocker step is
                return
        finally:
            stop.cancel()

    async def abort(self, request_id: str) -> None:
        ev = self._embeds.get(request_id)
        if ev is not None:
            ev.set()
        for rank in self._ranks:
            req = rank.sched.requests.get(request_id)
            if req is not None:
                rank.sched.finish(req, "abort")
                self._push(req, self._output(req, [], final=True))

    # --- control -----------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        self._awake.clear()
        if level >= 1:
            for rank in self._ranks:
                rank.pool.reset_prefix_cache(force=True)
                rank.flush_events()
        logger.info("mocker %s sleeping (level %d)", self.engine_id, level)

    async def wake_up(self) -> None:
        self._awake.set()

    async def is_sleeping(self) -> bool:
        return not self._awake.is_set()

    async def reset_prefix_cache(self) -> bool:
        ok = True
        for rank in self._ranks:
            ok = rank.pool.reset_prefix_cache() and ok
            rank.flush_events()
        return ok

    async def add_lora(self, lora: LoraRef) -> bool:
        if not self.args.enable_lora:
            raise ValueError("enable_lora is off")
        self._loras.add(lora)
        return True

    async def remove_lora(self, lora: LoraRef) -> bool:
        return self._loras.remove(lora)

    async def list_loras(self) -> list[int]:
        return self._loras.ids()

    async def check_health(self) -> None:
        if self._dead.is_set():
            raise EngineDeadError("mocker engine is dead")

    def inject_death(self) -> None:
        """Die now: in-flight generates raise EngineDeadError, check_health fails."""
        self._die("inject_death()")

    def inject_hang(self) -> None:
        """Stall every rank (streams stop, check_health still passes), until ``clear_hang``."""
        self._hung = True
        self._unhang.clear()

    def clear_hang(self) -> None:
        self._hung = False
        self._unhang.set()

    @property
    def dead(self) -> asyncio.Event:
        return self._dead

    def stats(self) -> list[EngineStats]:
        now = time.time()
        return [r.stats(now) for r in self._ranks]

    def take_steps(self) -> list[StepSample]:
        return [s for r in self._ranks for s in r.take_steps()]

    def kv_event_sources(self) -> list[KvEventSource]:
        return [src for r in self._ranks if (src := r.kv_event_source()) is not None]

