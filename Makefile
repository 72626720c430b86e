# Every target installs what it needs into .venv first, so a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 7700
DB ?= nulltickets.db
HOST ?= 127.0.0.1
PYTEST_ARGS ?=
# Tests run in parallel worker processes (pytest-xdist): most of their time is spent waiting on
# servers, leases and signals, not on the CPU. PYTEST_WORKERS=0 runs them here, one at a time.
PYTEST_WORKERS ?= 4

.PHONY: install postgres test-tools browser run test lint typecheck docs generate clean bench bench-quick bench-postgres bench-capacity binary test-binary binary-measure image test-image test-deploy

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt setup.py cext/core.py cext/walsync.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

# PostgreSQL from the distribution's packages, for the tests that start their own server
# (benchmarks/pgcluster.py); a no-op once pg_ctl is there.
postgres:
	@bash scripts/postgres.sh install

# curl and jq for the README's examples (a no-op once they are there).
test-tools:
	@bash scripts/test-tools.sh

run: install
	$(VENV)/bin/nulltickets serve --host $(HOST) --port $(PORT) --db $(DB)

# Debian's chromium and chromedriver for the dashboard's browser tests (a no-op once there).
browser:
	@bash scripts/browser.sh

test: install postgres test-tools browser
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks cext build release scripts docs/hooks
	$(VENV)/bin/ruff format --check src tests benchmarks cext build release scripts docs/hooks
	@if [ -x $(VENV)/bin/actionlint ]; then \
		$(VENV)/bin/actionlint .github/workflows/*.yml && \
		$(VENV)/bin/zizmor --offline --min-severity low .github/workflows; \
	else echo "actionlint/zizmor have no wheel for this machine: workflows not linted"; fi

# The clients' methods, one per call of nulltickets.client.Calls (tests/unit/test_verbs.py
# fails when they are stale).
generate: install
	$(PY) -m nulltickets.client.generate
	$(VENV)/bin/ruff check --fix --select I --quiet src/nulltickets/client/methods.py
	$(VENV)/bin/ruff format --quiet src/nulltickets/client/methods.py

typecheck: install
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on any broken link or
# warning. The API and error reference pages are rendered from the code (docs/hooks/).
docs: install
	$(PY) -m pip install --quiet -c constraints.txt -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build/lib dist site *.egg-info src/*.egg-info .pytest_cache

# The revision whose SQLite cycle rows `make bench` measures beside this tree's, interleaved
# (benchmarks/baseline.py): main just before the storage seam and PostgreSQL. Empty: none.
BENCH_BASELINE ?= ea98929

# PostgreSQL for the benchmark's postgres rows; when it cannot be installed, those rows say so.
bench-postgres:
	@bash scripts/postgres.sh install || echo "PostgreSQL not installed: the postgres rows will say so"

# The postgres section's table and capacity model, as docs/performance.md includes them.
POSTGRES_FIGURES ?= benchmarks/results/postgresql.md

bench: install bench-postgres
	$(PY) -m benchmarks --out bench-results.json --markdown bench-results.md \
		--postgres-figures $(POSTGRES_FIGURES) \
		$(if $(BENCH_BASELINE),--baseline $(BENCH_BASELINE))

# The postgres section alone (SQLite, PostgreSQL with synchronous_commit on and off behind 1 to 3
# servers, the peer queue, CPU per cycle, the capacity model): what regenerates its figures.
bench-capacity: install bench-postgres
	$(PY) -m benchmarks --sections postgres --out bench-postgres.json \
		--markdown bench-postgres.md --postgres-figures $(POSTGRES_FIGURES)

bench-quick: install bench-postgres
	$(PY) -m benchmarks --quick --out bench-results.json

# The long versions of the reliability suites (tests/reliability): 25 kill/restart cycles, minutes
# of abuse, thousands of fuzz examples. Then RELIABILITY.md is written from what they recorded
# (reliability-results.json), also when a suite failed; the exit status is pytest's.
.PHONY: soak
soak: install
	NULLTICKETS_SOAK=1 NULLTICKETS_RELIABILITY_JSON=reliability-results.json \
		$(PY) -m pytest tests/reliability $(PYTEST_ARGS); status=$$?; \
	$(PY) scripts/reliability_report.py reliability-results.json RELIABILITY.md && exit $$status

# The long power-cut suite alone (tests/reliability/test_power_cut.py: 50 cuts with full, 20 with
# normal); its rows replace that suite's in reliability-results.json, the other suites' stay.
.PHONY: soak-power-cut
soak-power-cut: install
	NULLTICKETS_SOAK=1 NULLTICKETS_RELIABILITY_JSON=power-cut-results.json \
		$(PY) -m pytest tests/reliability/test_power_cut.py $(PYTEST_ARGS); status=$$?; \
	$(PY) scripts/reliability_report.py --merge power-cut-results.json \
		reliability-results.json RELIABILITY.md && rm -f power-cut-results.json && exit $$status

# The standalone executable: dist/nulltickets-<os>-<arch>.bin (Nuitka onefile, see build/).
BINARY ?= $(shell $(PY) build/binary.py --print-path 2>/dev/null)

# apsw is rebuilt from its sdist against vendor/sqlite first (build/build_apsw.py), as every
# release job does, so this binary carries the release's SQLite, not the apsw wheel's.
binary: install
	$(PY) -m pip install --quiet -c constraints.txt -e '.[binary]'
	$(PY) build/build_apsw.py
	$(PY) build/binary.py

# The e2e suite against the built executable instead of `python -m nulltickets`.
test-binary: install
	@test -x "$(BINARY)" || { echo "no $(BINARY): run 'make binary' first"; exit 1; }
	PYTEST_WORKERS=$(PYTEST_WORKERS) bash build/test-binary.sh $(PY) $(BINARY) $(PYTEST_ARGS)

# The container image (Containerfile) with podman and runc, from a Debian 12 base image made
# here once with debootstrap (scripts/image.sh installs what is missing): localhost/nulltickets.
image: install
	@bash scripts/image.sh build

# The image as a user runs it (tests/image: a volume, SIGTERM, a restart, its user) and the
# agent-contract e2e tests with every server a container of it.
test-image: install postgres
	PYTEST_WORKERS=$(PYTEST_WORKERS) bash scripts/image.sh test $(PY)

# The README's binary figures: a cold build, then size, start-up and memory (build/measure.py).
binary-measure: install
	$(PY) -m pip install --quiet -c constraints.txt -e '.[binary]'
	$(PY) build/build_apsw.py
	$(PY) build/binary.py --cold
	$(PY) build/measure.py

# deploy/kube/nulltickets.yaml brought up with podman kube play: PostgreSQL, two servers and
# HAProxy, one server killed mid-run (tests/deploy). Builds the image (scripts/image.sh) and
# stand-ins for the postgres and haproxy images first; not part of `make test`.
test-deploy: install
	bash scripts/deploy-test.sh $(PY)
