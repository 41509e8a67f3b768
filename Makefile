# `make serve` and `make test` set themselves up on a fresh machine: a .venv, torch (CPU) first,
# then this package in editable mode. The stamp makes the install happen once per pyproject change.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
CONFIG  ?= deploy/configs/default.yaml
PROMPT  ?= Explain speculative decoding in one sentence.

.PHONY: venv install test gpu-check serve generate clean

venv: $(PY)
install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

# torch's wheel for this machine: the CPU build from PyTorch's CPU index where no NVIDIA driver is found (the
# default index's wheel is the CUDA build, gigabytes of libraries a CPU-only machine never uses), the default
# index's CUDA build where `nvidia-smi` runs; `make TORCH_INDEX=https://download.pytorch.org/whl/cu128 install`
# picks another (README, "Install")
TORCH_INDEX ?= $(if $(shell nvidia-smi -L 2>/dev/null),,https://download.pytorch.org/whl/cpu)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e '.[test,bench]'
	$(PY) -m deploy.rpc.codegen  # the gRPC modules from deploy/rpc/specfleet.proto (git-ignored)
	touch $@

# the whole suite on what this CPU runs (our kernels where it has their ISA), then the unit tier's fast part as a CPU
# without our kernels runs it: torch's ops, with torch's own kernels held to AVX2 (ATEN_CPU_CAPABILITY, oneDNN's
# DNNL_MAX_CPU_ISA), so the fallback an AVX2-only machine takes is tested on every machine. The unit tier's tests are
# independent and single-threaded: one pytest-xdist worker per core (up to 4) runs them; the tiers that start Ray
# clusters, Serve apps and network namespaces run one test at a time, as before. PYTHONFAULTHANDLER: a fatal signal
# after pytest's own handler is gone (a crash at interpreter exit, seen once after every test had passed) still
# prints every thread's Python stack
XDIST := -n auto --maxprocesses 4
test: export PYTHONFAULTHANDLER := 1
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=15 tests/unit
	$(PY) -m pytest -q --durations=30 tests/k8s tests/faults tests/ray tests/serve
	SPECFLEET_CPU_KERNELS=torch ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 \
		$(PY) -m pytest -q $(XDIST) -m "not slow and not heavy" tests/unit

# on a machine with a GPU (lent or own), within 8 minutes: the lossless unit tier and the pipeline and KV-link paths
# on CUDA (NCCL between two GPUs), `bench spec` on CUDA; the figures replace docs/benchmarks.md's gpu-check section.
# Without a CUDA device it stops at once: "no CUDA device"
gpu-check: $(STAMP)
	$(PY) -m deploy.cli bench gpu

# the local 3-node cluster (kept if it already runs), then the Serve app on it; `specfleet cluster down` stops all
serve: $(STAMP)
	@$(VENV)/bin/specfleet cluster status >/dev/null 2>&1 || $(VENV)/bin/specfleet cluster up --nodes 3
	$(VENV)/bin/specfleet serve --config $(CONFIG) --try "$(PROMPT)"

generate: $(STAMP)  # offline generation in one process, no cluster
	$(VENV)/bin/specfleet generate --config $(CONFIG) --prompt "$(PROMPT)"

clean:  # build outputs and caches; `rm -rf .venv` for a full reset
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
