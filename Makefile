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
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

# The suite against another megatron-core (README, "Megatron-Core versions"): its own venv,
# .venv-mcore<version>, built by tools/mcore_env.py (the cp312 wheel's Python sources unpacked,
# so it also runs on a Python older than the 3.12 that megatron-core 0.17+ declares).
MCORE       ?= 0.19.2
MCORE_VENV  := .venv-mcore$(MCORE)
MCORE_STAMP := $(MCORE_VENV)/.installed
# tests/test_gpu_check.py checks the GPU check's own install step (a pinned megatron-core wheel
# from .wheelhouse/), not this project against MCore: it runs in `make test` only.
MCORE_PYTEST_ARGS ?= --ignore=tests/test_gpu_check.py

$(MCORE_STAMP): pyproject.toml tools/mcore_env.py
	python3 tools/mcore_env.py $(MCORE) $(MCORE_VENV)
	touch $(MCORE_STAMP)

test-mcore: $(MCORE_STAMP)
	$(MCORE_VENV)/bin/python -m pytest -q -ra $(MCORE_PYTEST_ARGS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run

# GPU acceptance check on one CUDA GPU with no network (README, "GPU acceptance check"): the
# machine's python3 and CUDA torch, megatron-core $(MCORE) and missing pure-Python packages from
# .wheelhouse/; never creates .venv; everything it writes goes under $(OUT). GPU_CHECK_ARGS:
# more options of tools/gpu_check.py (e.g. --only A).
# GPU_CHECK_DRY_RUN=1: the same stages on CPU in the existing .venv.
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
