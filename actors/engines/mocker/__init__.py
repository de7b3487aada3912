"""A simulated vLLM engine (scheduler, KV pool, timing model, vLLM-identical KV events); the engine is
``actors.engines.mocker.engine.MockerEngine``."""
