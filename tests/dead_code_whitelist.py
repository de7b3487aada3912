# Names vulture cannot see used, each with who uses it (read by tests/test_dead_code.py, never imported).
# ruff: noqa
_ = object()

# vLLM's ZMQ KV-event Structs (actors/engines/kv_events.py) mirror vLLM's classes field for field:
# msgspec decodes array-like messages by position, so a field nobody reads must still be declared.
MEDIUM_CPU, MEDIUM_STORAGE  # the media vLLM may name besides GPU
_.kv_cache_spec_sliding_window, _.locality, _.ownership, _.session_id

# vLLM's stat-logger interface (actors/engines/vllm_stats.py): vLLM calls these by name.
mm_cache_stats  # a parameter of StatLoggerBase.record
_.log_engine_initialized

# aiohttp calls RequestHandler.handle_error for what its parser refused (actors/frontend/http_guard.py).
_.handle_error

# the tokenizers library reads these attributes when it encodes (actors/models/tiny.py).
_.pre_tokenizer, _.post_processor

# wire fields: read by NATS clients (the CLI, operators), not by our code.
_.uptime  # HealthReply
_.ttft_p90_ms, _.itl_p90_ms, _.last_decision  # the planner's Observed and PlannerStatus
_.wake_pending  # PlannerStatus: the keeper's wakes and idle stops in progress
_.wakes  # PlannerStatus: the keeper's recent outcomes (read as JSON: nats req <ns>.planner.status)

# result fields written to the benchmark's JSON output (bench/frontend_bench.py).
_.latency_avg, _.wrk_cpu_s

# http.server calls these by name (tests/otlp_receiver.py).
_.do_POST, _.log_message

# pytest reads these by name.
pytestmark
_.optionxform  # configparser: keep the case of systemd keys (tests/deploy/test_systemd.py)
pytest_runtest_call  # hook (tests/conftest.py)
pytest_collection_modifyitems  # hook (tests/conftest.py): the shared vLLM stack's tests together
event_loop_policy  # fixture pytest-asyncio looks up by name
pytest_xdist_make_scheduler  # pytest-xdist hook (tests/conftest.py): make test's work units
_._split_scope  # LoadScopeScheduling calls it (tests/conftest.py's scheduler)
_.ValueClass  # prometheus_client's value class, swapped by tests/worker/test_status_metrics.py

# vLLM's DelegatingParser reads it (actors/frontend/output_parsing.py switches reasoning off for an
# output whose prompt already closed the thinking).
_._reasoning_parser

# transformers' save_pretrained writes it into the tiny VLM's config.json (actors/models/tiny_vlm.py)
_.architectures

# vLLM's pooling checks read them off the ModelConfig stand-in the frontend builds from a model card
# (actors/frontend/embeddings.py: PoolingParams.verify, EmbeddingCompletionRequest.build_tok_params).
_.pooler_config, _.encoder_config
