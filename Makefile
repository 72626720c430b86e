# Every target installs what it needs into .venv first, so a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 7700
DB ?= nulltickets.db
HOST ?= 127.0.0.1
PYTEST_ARGS ?=

.PHONY: install run test lint typecheck clean bench bench-quick

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

run: install
	$(VENV)/bin/nulltickets serve --host $(HOST) --port $(PORT) --db $(DB)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	@if [ -x $(VENV)/bin/actionlint ]; then \
		$(VENV)/bin/actionlint .github/workflows/*.yml && \
		$(VENV)/bin/zizmor --offline --min-severity low .github/workflows; \
	else echo "actionlint/zizmor have no wheel for this machine: workflows not linted"; fi

typecheck: install
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build/lib dist *.egg-info src/*.egg-info .pytest_cache

bench: install
	$(PY) -m benchmarks --out bench-results.json --markdown bench-results.md

bench-quick: install
	$(PY) -m benchmarks --quick --out bench-results.json
