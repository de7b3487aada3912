"""An engine's failed start, classified: a rejected configuration is ``Misconfigured`` (the worker
gives up at once and exits with EXIT_CONFIG), anything else stays the error it was (restarted)."""

from __future__ import annotations

import pytest

from actors.engines.config_error import EngineConfigError
from actors.worker.engine_errors import start_failure
from actors.worker.engine_factory import build_engine
from config.loader import topology_from_dict
from supervisors.child import Misconfigured

MODEL = {"name": "m", "path": "tiny"}


def test_a_rejected_configuration_is_misconfigured_and_anything_else_is_kept() -> None:
    failure = start_failure(EngineConfigError("bad dtype", ("dtype",)))
    assert isinstance(failure, Misconfigured) and str(failure) == "engine configuration rejected: bad dtype"
    died = RuntimeError("Engine core initialization failed")
    assert start_failure(died) is died
    oom = MemoryError()
    assert start_failure(oom) is oom


def test_mocker_args_it_refuses_are_an_engine_config_error() -> None:
    t = topology_from_dict({"model": MODEL, "pools": {"agg": {"engine": "mocker", "engine_args": {"bogus": 1}}},
                            "frontend": {"enabled": False}})
    with pytest.raises(EngineConfigError, match="mocker engine args: unknown mocker engine arg 'bogus'"):
        build_engine(t.pools["agg"], t.model)


async def test_a_vllm_engine_whose_args_vllm_rejects_fails_its_start_with_an_engine_config_error() -> None:
    """Rejected while its config is built, before any engine process exists."""
    t = topology_from_dict({"model": MODEL, "pools": {"agg": {"engine": "vllm", "engine_args": {
        "dtype": "float7", "max_model_len": 256}}}, "frontend": {"enabled": False}})
    engine = build_engine(t.pools["agg"], t.model)
    with pytest.raises(EngineConfigError, match="vLLM rejected the engine args: 2 validation errors for "
                                                "ModelConfig: dtype") as info:
        await engine.start()
    assert "dtype" in info.value.keys
    assert isinstance(start_failure(info.value), Misconfigured)
