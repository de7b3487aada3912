"""The mocker's data-parallel ranks: each one a KV block pool, a scheduler, a ZMQ KV-event publisher
(none for decode, which publishes no events), the task that runs its steps and the samples of the
steps it ran (``StepSample``, for the load-mode planner); plus the per-request sink its steps
deliver to. Built all or nothing: a rank that fails to bind closes the ones before.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from actors.engines.mocker.config import MockerArgs
from actors.engines.mocker.kv_events import ZmqKvEventPublisher
from actors.engines.mocker.kv_pool import BlockPool
from actors.engines.mocker.scheduler import MockRequest, Scheduler, StepResult
from actors.engines.mocker.text_codec import IncrementalDetokenizer
from actors.engines.protocol import (
    NO_KV_EVENT_ROLES,
    EngineOutput,
    EngineStats,
    KvEventSource,
    Role,
    SamplingOptions,
    StepSample,
)

# Step samples a rank keeps until the engine actor takes them (about a second of steps is taken
# at a time; more is only kept while nobody takes them, and then the oldest go first).
MAX_STEP_SAMPLES = 4096


class Rank:
    def __init__(self, dp_rank: int, pool: BlockPool, sched: Scheduler,
                 publisher: ZmqKvEventPublisher | None) -> None:
        self.dp_rank = dp_rank
        self.pool = pool
        self.sched = sched
        self.publisher = publisher
        self.work = asyncio.Event()  # set when a request arrives for an idle loop
        self.task: asyncio.Task[None] | None = None
        self.steps: deque[StepSample] = deque(maxlen=MAX_STEP_SAMPLES)

    def blocks_in_step(self, res: StepResult) -> int:
        """KV blocks the step's batch held: those in use now plus those its finished requests
        released at its end (each counted once: a released block another request still holds is
        in use)."""
        ref = self.pool.ref_cnt
        released = {b for req in res.finished for b in req.released_blocks if ref[b] == 0}
        return self.pool.num_used + len(released)

    def record_step(self, res: StepResult, kv_blocks: int, elapsed_s: float) -> None:
        """One step that computed something: its prefill tokens and decodes, the KV blocks its batch
        held (``blocks_in_step``), and its wall time (scheduling and the simulated compute)."""
        if not res.scheduled:
            return  # nothing was computed (every waiting request blocked): no sample of step time
        self.steps.append(StepSample(prefill_tokens=res.prefill_tokens, decode_requests=res.num_decode,
                                     kv_tokens=kv_blocks * self.pool.block_size,
                                     elapsed_ms=elapsed_s * 1000.0, dp_rank=self.dp_rank))

    def take_steps(self) -> list[StepSample]:
        out = list(self.steps)
        self.steps.clear()
        return out

    def flush_events(self) -> None:
        events = self.pool.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def close_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def stats(self, now: float) -> EngineStats:
        s, p = self.sched, self.pool
        return EngineStats(
            dp_rank=self.dp_rank, num_running=len(s.running), num_waiting=len(s.waiting),
            kv_usage=p.usage, active_kv_blocks=p.num_used, total_kv_blocks=p.num_blocks,
            prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits, step=s.step_count, ts=now)

    def kv_event_source(self) -> KvEventSource | None:
        pub = self.publisher
        if pub is None:
            return None
        return KvEventSource(dp_rank=self.dp_rank, endpoint=pub.endpoint,
                             replay_endpoint=pub.replay_endpoint, topic=pub.topic)


def build_ranks(a: MockerArgs, role: Role, kv_events_port: int,
                sample: Callable[[MockRequest], int]) -> list[Rank]:
    """``a.dp_size`` ranks, their publishers bound (ports from ``kv_events_port``, 0: any free)."""
    ranks: list[Rank] = []
    try:
        for r in range(a.dp_size):
            pool = BlockPool(a.num_gpu_blocks, a.block_size, a.enable_prefix_caching,
                             emit_events=role not in NO_KV_EVENT_ROLES)
            sched = Scheduler(pool, max_num_seqs=a.max_num_seqs,
                              max_num_batched_tokens=a.max_num_batched_tokens,
                              max_model_len=a.max_model_len,
                              enable_chunked_prefill=a.enable_chunked_prefill,
                              max_loras=a.max_loras, sample=sample)
            pub = None
            if role not in NO_KV_EVENT_ROLES:
                base = kv_events_port
                pub = ZmqKvEventPublisher(
                    r, pub_port=base + r if base else 0,
                    replay_port=base + a.dp_size + r if base else 0,
                    buffer_steps=a.kv_events_buffer_steps)
                pub.start()
            ranks.append(Rank(r, pool, sched, pub))
    except Exception:
        for rank in ranks:
            rank.close_publisher()
        raise
    return ranks


class Sink:
    """Where a request's outputs go: the queue its ``generate`` reads (an error ends the stream);
    ``detok`` makes its output text when the mocker has a tokenizer."""

    __slots__ = ("detok", "queue", "sampling")

    def __init__(self, sampling: SamplingOptions, detok: IncrementalDetokenizer | None = None) -> None:
        self.sampling = sampling
        self.detok = detok
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
