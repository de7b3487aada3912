# Two commands for a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TOPOLOGY ?= topologies/agg.toml

.PHONY: install model run test test-fast lint bench clean

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

model: install
	$(PY) -m actors.models.tiny
	$(PY) -m actors.models.tiny_vlm

run: model
	$(PY) -m actors.supervisor $(TOPOLOGY)

# systemd-analyze is needed by the unit-file tests, iproute2's `ip` by the multi-host tests (network
# namespaces); install them when missing.
test: install
	@command -v systemd-analyze >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null)
	@command -v ip >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null)
	$(PY) -m actors.models.tiny
	$(PY) -m actors.models.tiny_vlm
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: install
	$(PY) -m pytest -q -m "not vllm"

lint: install
	$(VENV)/bin/ruff check actors bus supervisors config deploy tests bench

clean:
	rm -rf $(VENV) build *.egg-info
