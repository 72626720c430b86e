# Every target installs what it needs into .venv first, so a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 7700
DB ?= nulltickets.db
HOST ?= 127.0.0.1
PYTEST_ARGS ?=

.PHONY: install run test lint typecheck clean bench bench-quick binary test-binary binary-measure

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

# The standalone executable: dist/nulltickets-<os>-<arch>.bin (Nuitka onefile, see build/).
BINARY ?= $(shell $(PY) build/binary.py --print-path 2>/dev/null)

binary: install
	$(PY) -m pip install --quiet -e '.[binary]'
	$(PY) build/binary.py

# The e2e suite against the built executable instead of `python -m nulltickets`.
test-binary: install
	@test -x "$(BINARY)" || { echo "no $(BINARY): run 'make binary' first"; exit 1; }
	bash build/test-binary.sh $(PY) $(BINARY) $(PYTEST_ARGS)

# The README's binary figures: a cold build, then size, start-up and memory (build/measure.py).
binary-measure: install
	$(PY) -m pip install --quiet -e '.[binary]'
	$(PY) build/binary.py --cold
	$(PY) build/measure.py
