# Two commands: `make demo` (a small RL run on CPU) and `make test`.
# Each creates .venv on first use; re-running is a no-op unless pyproject.toml changed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint bench clean gpu-check wheelhouse

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
	rm -rf $(VENV) *.egg-info
