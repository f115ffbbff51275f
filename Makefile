# trt_sora — the two commands a fresh machine needs:
#   make engine RECIPE=rtx4090-fp8      # every stage on the embedded default model
#   make test                           # the test suite (what CI runs)
PY      ?= python3
VENV    ?= .venv
RECIPE  ?= rtx4090-fp8
MODEL   ?=
SHARDS  ?=
OUT     ?= build
BIN      = $(VENV)/bin
EXTRAS  ?= export,ort,tensorrt-rtx,serve,dev
# CI's exact versions (pyproject.toml keeps ranges); `make install CONSTRAINTS=` resolves freely.
CONSTRAINTS ?= .ci/constraints.txt
PIN      = $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# pytest-xdist: one worker per logical CPU, each test file whole on one worker (its module fixtures built
# once, its tests in order); PYTEST_JOBS= runs the suite in one process.
PYTEST_JOBS ?= -n logical --dist loadfile

.PHONY: install test test-fast engine export proto clean distclean help

help:
	@echo "make install | test | engine RECIPE=<recipe> [MODEL=<name-or-path>] [SHARDS=<n>] | clean"

# The constraints pin torch 2.13.0: on our CPU machines pip takes the CPU build from local disk
# instead of pulling a multi-GB CUDA build. On GPU boxes install your CUDA torch first and use
# EXTRAS=export,ort-gpu,tensorrt CONSTRAINTS= (onnxruntime-gpu replaces the CPU onnxruntime).
install: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: keeping pip's default torch build"; \
	  else $(BIN)/pip install -q $(PIN) torch; fi
	$(BIN)/pip install -q $(PIN) -e '.[$(EXTRAS)]'
	$(BIN)/pip check
	@touch $@

# Lint first (ruff: pyflakes, pycodestyle, import order, bugbear, pyupgrade; pyproject.toml's
# [tool.ruff]), then the suite, then the fast mutation check (each deliberate bug of
# tests/mutations.py --fast must fail the tests that guard it): any failure fails `make test` and CI.
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_JOBS)
	$(BIN)/python tests/mutations.py --fast

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_JOBS)

# export -> calibrate -> quantize -> build -> check under $(OUT)/<model>/$(RECIPE)/
# SHARDS=n: calibrate as n shards and merge them (the same stats as one pass)
engine: install
	$(BIN)/trt-sora engine --recipe $(RECIPE) $(if $(MODEL),--model $(MODEL)) $(if $(SHARDS),--calib-shards $(SHARDS)) --out $(OUT)

export: install
	$(BIN)/trt-sora export --recipe $(RECIPE) $(if $(MODEL),--model $(MODEL)) --out $(OUT)/export

# The gRPC stubs beside trt_sora/serve/proto/trt_sora.proto (committed; tests/serve/test_grpc.py checks them).
proto: install
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \
	  trt_sora/serve/proto/trt_sora.proto

clean:
	rm -rf $(OUT) .pytest_cache

distclean: clean
	rm -rf $(VENV) *.egg-info
