"""A mocker deployment booted with the CLI takes 2,800+ fuzzed requests over chat, completions,
responses and messages (tests/chaos/http_fuzz.py) and the issue's requests of death: no 5xx, every
error in its API's shape, and afterwards the same worker
still serves a normal request (no restart, no new instance). An embedding model's deployment
(topologies/mocker-embed.toml) takes 700 fuzzed /v1/embeddings requests the same way.

Memory: every worker-bound integer is checked against the model's limits before anything is built
for it (actors.engines.limits), so no case can make the worker allocate per requested item any
more. In case one still did, the deployment's processes get an address-space limit of what they use
at boot plus a margin: a runaway allocation is then a MemoryError (a 500 or a restart, which fail
this test) instead of the OOM killer picking a process of this machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.chaos.http_fuzz import (
    CHAT,
    EMBED_PATHS,
    EMBEDDINGS,
    cap_memory,
    draw_cases,
    explicit_embedding_cases,
    run_http_fuzz,
)
from tests.e2e.conftest import Deployment, boot, chat_body, post, shutdown

pytestmark = [pytest.mark.slow]

MODEL = "tiny"
CASES = 2800  # 700 per API, as many as chat and completions had when they were the only two
SEED = 20261124
# cheap valid requests: a short context bounds what "max_tokens absent" (= the context left) costs,
# and zero compute means no simulated step time
SETS = ["pools.agg.engine_args.max_model_len=128", "pools.agg.engine_args.speedup_ratio=0"]


@pytest.fixture(scope="module")
def fuzz_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, list]]:
    # drawing the cases takes seconds of CPU: do it while the deployment boots
    with ThreadPoolExecutor(1) as ex:
        drawn = ex.submit(draw_cases, MODEL, CASES, SEED)
        d = boot(tmp_path_factory, "fuzz", "mocker-agg.toml", ready={"agg": 1}, sets=SETS)
        cases = drawn.result()
    try:
        assert d.proc is not None
        cap_memory(d.proc.pid)
        yield d, cases
    finally:
        shutdown(d)


def test_fuzzed_requests_are_2xx_or_api_shaped_4xx_and_the_worker_survives(fuzz_setup: tuple) -> None:
    d, cases = fuzz_setup
    before = sorted(d.instances())
    log_at = d.log.stat().st_size
    assert before, d.output()
    figures = run_http_fuzz(d.url, MODEL, cases, SEED)
    print("http fuzz figures:", json.dumps({k: v for k, v in figures.items() if k != "examples"}))
    detail = json.dumps(figures["examples"], indent=1)[:6000]
    assert figures["cases"] >= CASES
    assert figures["server_errors"] == 0, detail
    assert figures["bad_error_bodies"] == 0, detail
    assert figures["failures"] == 0, detail
    assert figures["status"].get("200", 0) > 100 and figures["status"].get("400", 0) > 100, figures["status"]
    # the same worker still serves, and nothing restarted meanwhile
    code, _, text = post(d.url + CHAT, chat_body(MODEL))
    assert code == 200, text
    assert sorted(d.instances()) == before
    with open(d.log, "rb") as f:
        f.seek(log_at)
        later = f.read().decode(errors="replace")
    assert "; restarting " not in later and " died" not in later, later[-3000:]


EMBED_MODEL = "tiny-embed"
EMBED_CASES = 700
EMBED_SETS = ["pools.embed.engine_args.max_model_len=128", "pools.embed.replicas=1"]


@pytest.fixture(scope="module")
def embed_fuzz_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, list]]:
    with ThreadPoolExecutor(1) as ex:
        drawn = ex.submit(draw_cases, EMBED_MODEL, EMBED_CASES, SEED, EMBED_PATHS)
        d = Deployment("mocker-embed.toml", tmp_path_factory.mktemp("embedfuzz"),
                       namespace=f"e2eembedfuzz{os.getpid()}", sets=EMBED_SETS, model=EMBED_MODEL)
        d.start()
        try:
            d.wait_ready({"embed": 1}, 60)
        except BaseException:
            d.stop(20)
            raise
        cases = drawn.result()
    try:
        assert d.proc is not None
        cap_memory(d.proc.pid)
        yield d, cases
    finally:
        shutdown(d)


def test_fuzzed_embeddings_are_2xx_or_api_shaped_4xx_and_the_worker_survives(embed_fuzz_setup: tuple) -> None:
    d, cases = embed_fuzz_setup
    before = sorted(d.instances())
    assert before, d.output()
    figures = run_http_fuzz(d.url, EMBED_MODEL, explicit_embedding_cases(EMBED_MODEL) + cases, SEED,
                            explicit=False)
    print("embeddings fuzz figures:", json.dumps({k: v for k, v in figures.items() if k != "examples"}))
    detail = json.dumps(figures["examples"], indent=1)[:6000]
    assert figures["cases"] >= EMBED_CASES
    assert figures["failures"] == 0, detail
    assert figures["status"].get("200", 0) > 50 and figures["status"].get("400", 0) > 50, figures["status"]
    code, _, text = post(d.url + EMBEDDINGS, {"model": EMBED_MODEL, "input": "still here"})
    assert code == 200, text
    assert sorted(d.instances()) == before
