# Two commands on a fresh machine: `make demo` and `make test`. Each builds its own virtual
# environment (.venv) first. Without an NVIDIA GPU the CPU build of torch is installed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# With a GPU: the CUDA build from PyPI. Without: the CPU build (a local +cpu wheel if pip can see one,
# else PyTorch's CPU index), never the several GB of CUDA packages.
ifeq ($(HAS_GPU),1)
INSTALL_TORCH = $(PIP) install -q torch==$(TORCH_VERSION)
else
INSTALL_TORCH = $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	$(PIP) install -q torch==$(TORCH_VERSION) --index-url https://download.pytorch.org/whl/cpu
endif

.PHONY: demo test test-fast test-kernels test-gpu test-conformance lint bench venv clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(INSTALL_TORCH)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base scripts/install_kernels_cpu.sh scripts/fetch_transformers_tests.sh
	$(PIP) install -q -e ".[test]"
	bash scripts/install_kernels_cpu.sh $(VENV)
	bash scripts/fetch_transformers_tests.sh $(VENV)
	touch $@

venv: $(VENV)/.base

demo: $(VENV)/.base
	$(VENV)/bin/hybrid-pack demo --out runs/demo

test: $(VENV)/.test
	$(PY) -m pytest -q -n 2 -p no:cacheprovider tests --ignore=tests/kernels --ignore=tests/gpu
	$(MAKE) --no-print-directory test-kernels

# transformers' own common model tests over every supported family, unpatched and patched, with the table.
test-conformance: $(VENV)/.test
	$(PY) scripts/conformance_table.py

lint: $(VENV)/.test
	$(VENV)/bin/ruff check hybrid_pack tests benchmarks examples scripts models

# The real Triton kernels of flash-linear-attention and mamba-ssm, on CPU in Triton's interpreter.
test-kernels: $(VENV)/.test
	TRITON_INTERPRET=1 HYBRID_PACK_REQUIRE_KERNELS=1 $(PY) -m pytest -q -p no:cacheprovider -m kernels tests/kernels

# Kernels at real sizes, models and training on CUDA; without a GPU every test skips with its reason.
ifeq ($(HAS_GPU),1)
$(VENV)/.gpu: $(VENV)/.test scripts/install_kernels_gpu.sh
	bash scripts/install_kernels_gpu.sh $(VENV)
	touch $@
test-gpu: $(VENV)/.gpu
else
test-gpu: $(VENV)/.test
endif
	$(PY) -m pytest -q -p no:cacheprovider -rs tests/gpu

test-fast: $(VENV)/.test
	$(PY) -m pytest -q -n 2 -p no:cacheprovider -m "not slow and not distributed and not conformance" tests \
		--ignore=tests/kernels --ignore=tests/gpu

bench: $(VENV)/.test
	$(PIP) install -q -e ".[bench]"
	$(VENV)/bin/hybrid-pack bench

clean:
	rm -rf $(VENV) runs build *.egg-info
