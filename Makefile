# Two commands: `make demo` (a small RL run on CPU) and `make test`.
# Each creates .venv on first use; re-running is a no-op unless pyproject.toml changed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-mcore lint bench clean gpu-check wheelhouse

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m scalerlt_mcore.train

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q -ra --durations=15 $(PYTEST_ARGS)

# The suite against another megatron-core (docs/testing.md, "Megatron-Core versions"): its own
# venv, .venv-mcore<version>, built by tools/mcore_env.py (the cp312 wheel's Python sources
# unpacked, so it also runs on a Python older than the 3.12 that megatron-core 0.17+ declares).
MCORE       ?= 0.19.2
MCORE_VENV  := .venv-mcore$(MCORE)
MCORE_STAMP := $(MCORE_VENV)/.installed
MCORE_PYTEST_ARGS ?=  # more pytest options for test-mcore
# MCORE_SUBSET=1: only MCORE_CI_TESTS, the tests that meet MCore's API: the CPU-backend patches
# and version checks, GPTModel parity, stock-schedule parity, MCore DDP + distributed optimizer,
# tensor parallelism, the layer specs, MCore's linears' and layer's direct forwards, the
# checkpoint importers (Nanbeige's too), activation recompute through MCore's checkpoint, the
# prefix and decode paths
# through MCore's TransformerLayer, Megatron-LM's train_step, and the main job end to end
# (torchrun, checkpoints, resume, SIGTERM). `.ci/run` runs them against 0.19.2 after `make
# test`'s whole suite: 254 passed, 1 skipped (the TE spec test) in 453 s (7 min 33 s; 467 s
# with start-up) on this 2-core machine, shared with other jobs (2026-12-02; 626 s under a
# heavier load); the whole 0.19.2 suite takes about 17 minutes, its environment about 6 to
# build, `make test` 15 to 18.
MCORE_SUBSET ?=
MCORE_CI_TESTS := \
	tests/test_cpu_backend.py tests/test_mcore_compat.py tests/test_distributed_cpu.py \
	tests/model/test_model_anchor.py tests/model/test_model_specs.py \
	tests/model/test_core_attention_spec.py tests/model/test_model_prefix.py \
	tests/model/test_linear.py tests/model/test_layer.py tests/model/test_model_decode.py tests/model/test_looped_import.py \
	tests/model/test_pretrained_import.py tests/model/test_nanbeige_import.py \
	tests/app/test_nanbeige_app.py tests/shared_prefix/test_recompute.py \
	tests/shared_prefix/test_joint_replay_exact.py tests/shared_prefix/test_joint_replay_sft.py \
	tests/shared_prefix/test_joint_replay_ddp.py tests/shared_prefix/test_looped_features_ddp.py \
	tests/shared_prefix/test_tensor_parallel.py tests/model/test_family_tp.py \
	tests/app/test_megatron_train_step.py tests/app/test_train_e2e.py \
	tests/app/test_train_signals.py
MCORE_TESTS = $(if $(filter-out 0,$(MCORE_SUBSET)),$(MCORE_CI_TESTS))

$(MCORE_STAMP): pyproject.toml tools/mcore_env.py
	python3 tools/mcore_env.py $(MCORE) $(MCORE_VENV)
	touch $(MCORE_STAMP)

test-mcore: $(MCORE_STAMP)
	$(MCORE_VENV)/bin/python -m pytest -q -ra $(MCORE_PYTEST_ARGS) $(PYTEST_ARGS) $(MCORE_TESTS)

bench: $(STAMP)
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.scale
	$(PY) -m benchmarks.subdivided

# GPU acceptance check on one CUDA GPU with no network (docs/gpu.md, "The GPU acceptance
# check"): the machine's python3 and CUDA torch, megatron-core $(MCORE) and missing
# pure-Python packages from .wheelhouse/; never creates .venv; everything it writes goes under
# $(OUT). GPU_CHECK_ARGS: more options of tools/gpu_check.py (e.g. --only A).
# GPU_CHECK_DRY_RUN=1: the same stages on CPU under the interpreter holding megatron-core $(MCORE)
# (.venv, or .venv-mcore$(MCORE) from `make test-mcore`; refused, naming that, when neither).
GPU_CHECK_DRY := $(filter-out 0,$(GPU_CHECK_DRY_RUN))
GPU_CHECK_PY := $(if $(GPU_CHECK_DRY),$(PY),python3)
MCORE ?= 0.19.2
OUT ?= .gpu-check/out
GPU_CHECK_ARGS ?=

gpu-check:
	@test -x $(GPU_CHECK_PY) || command -v $(GPU_CHECK_PY) >/dev/null || \
		{ echo "gpu-check: $(GPU_CHECK_PY) not found (the dry run uses .venv: run make test first)"; exit 1; }
	$(GPU_CHECK_PY) tools/gpu_check.py --out $(OUT) --mcore $(MCORE) $(if $(GPU_CHECK_DRY),--dry-run) $(GPU_CHECK_ARGS)

# On a machine with package access: the wheels gpu-check installs (CPython 3.12, x86_64):
# megatron-core 0.19.2 and 0.16.1, and the pure-Python test packages.
wheelhouse:
	python3 tools/gpu_check.py wheelhouse

clean:
	rm -rf $(VENV) .venv-mcore* *.egg-info
