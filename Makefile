# Two commands: `make demo` (a small RL run on CPU) and `make test`.
# Each creates .venv on first use; re-running is a no-op unless pyproject.toml changed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint bench clean

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

clean:
	rm -rf $(VENV) *.egg-info
