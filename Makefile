# pgoutbox — `make` lists the targets. `make demo` and `make test` are the two
# commands a fresh machine needs; both install what is missing first.
.DEFAULT_GOAL := help
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(VENV)/bin/pytest
# Workers for the server tiers: the tests mostly wait on PostgreSQL, NATS and
# subprocesses, so more workers than cores pay (measured on 2 cores: see tests/README.md).
# Heavy groups stay on one worker each (--dist loadgroup, tests/conftest.py); the three
# 5-minute outages hold a worker each, mostly waiting: 6 for the rest, as measured, plus 3.
WORKERS ?= 9
XDIST := -n $(WORKERS) --dist loadgroup

.PHONY: help setup demo test test/unit test/quick test/poison test/sql verify/schema verify/migrations generate/migrations verify/docs docs/reference lint bench/sql bench/consumer bench/consumer-loop bench/relay bench/traces bench/dlq bench/e2e bench/archive bench/console bench/guard docs/screenshots bench chaos clean

help: ## List the targets
	@grep -hE '^[a-zA-Z0-9/_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-20s %s\n", $$1, $$2}'

setup: ## Install Debian packages (if missing) and the .venv (if stale)
	@bash scripts/bootstrap.sh

demo: setup ## Run the demo on an embedded PostgreSQL + NATS under .data/
	@$(PY) -m pgoutbox.dev.demo

test: setup ## Run the whole test suite: the unit tier first (seconds), then pgTAP and pytest on real PostgreSQL and NATS (WORKERS=n)
	@# The Spark JVMs' class archive (tests/support/jvm_archive.py) on the other core meanwhile.
	@$(PY) tests/support/jvm_archive.py & archive=$$!; $(PYTEST) -q tests/unit; unit=$$?; wait $$archive; exit $$unit
	@$(PYTEST) -q $(XDIST) --durations=25 --ignore=tests/unit

test/unit: setup ## The unit tier only: no server, in-memory fakes (seconds)
	@$(PYTEST) -q tests/unit

test/quick: setup ## The suite without slow and Spark tests
	@$(PYTEST) -q tests/unit
	@$(PYTEST) -q $(XDIST) --ignore=tests/unit -m "not slow and not spark"

test/poison: setup ## The poison pipeline test, long Hypothesis profile (EXAMPLES=n per class, default 200)
	@PGOUTBOX_HYPOTHESIS_PROFILE=long PGOUTBOX_POISON_EXAMPLES=$(or $(EXAMPLES),200) $(PYTEST) -q -p no:cacheprovider tests/chaos/test_poison_pipeline.py

test/sql: setup ## pgTAP files only (through pg_prove)
	@$(PYTEST) -q tests/schema/test_pgtap.py

verify/schema: setup ## sql/ and migrations/ build the same catalog; round trip
	@$(PYTEST) -q tests/schema/test_migrations.py

verify/migrations: setup ## The newest migration's generated blocks equal their sql/ definitions (fails on drift)
	@$(PY) scripts/gen_migrations.py --check

generate/migrations: setup ## Rewrite the newest migration's generated blocks from sql/
	@$(PY) scripts/gen_migrations.py

.PHONY: generate/extension verify/extension install/extension sdist wheel

generate/extension: ## Build extension/'s control file and scripts from migrations/ (git ignores them)
	@$(MAKE) --no-print-directory -C extension $(if $(PG_CONFIG),PG_CONFIG=$(PG_CONFIG))

verify/extension: setup ## The extension built from migrations/ installs, builds the plain catalog, dumps and restores
	@$(PYTEST) -q tests/install/test_extension.py

install/extension: ## Build and install the extension files into the PostgreSQL that pg_config names (PG_CONFIG=...)
	@$(MAKE) --no-print-directory -C extension install $(if $(PG_CONFIG),PG_CONFIG=$(PG_CONFIG))

sdist: ## Build the sdist into dist/: it carries the generated extension scripts (PY=python with `build`)
	@python3 scripts/gen_extension.py >/dev/null
	@$(PY) -m build --sdist --outdir dist . >/dev/null

wheel: setup sdist ## Build the sdist, then the wheel from it, into dist/ (pip install dist/pgoutbox-*.whl)
	@$(VENV)/bin/pip wheel --no-deps -q -w dist dist/pgoutbox-$$($(PY) -c 'import pgoutbox; print(pgoutbox.__version__)').tar.gz
	@ls dist

verify/docs: setup ## README and docs/reference.md: tables match the code, examples run as written
	@$(PYTEST) -q tests/cli/test_docs.py tests/unit/test_docs_tables.py tests/unit/test_relay_docs.py tests/unit/test_consumer_docs.py

docs/reference: setup ## Regenerate the settings and metrics tables of docs/reference.md from the code
	@$(PY) scripts/reference_tables.py

docs/chart: setup ## Redraw docs/images/delivery_report.png (the delivery chart of docs/archival.md) from sample data
	@$(PY) scripts/sample_chart.py docs/images/delivery_report.png

lint: setup ## ruff (lint, format), mypy, import-linter and sqlfluff (CI runs it before the tests; also .pre-commit-config.yaml)
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy -p pgoutbox -p pgoutbox_spark -p harness
	@$(VENV)/bin/lint-imports --no-logo
	@$(VENV)/bin/sqlfluff lint sql/ migrations/ pgtap/

bench/sql: setup ## Emit and claim throughput figures (not a test)
	@$(PY) bench/sql_bench.py

bench/consumer: setup ## Consumer throughput vs a bare JetStream fetch-and-ack loop (not a test)
	@$(PY) bench/consumer_bench.py

bench/consumer-loop: setup ## pgoutbox consume (defaults) vs a hand-written inbox loop, same messages and handler (ROUNDS=n)
	@$(PY) bench/consumer_bench.py --only g --rounds $(or $(ROUNDS),3)

bench/e2e: setup ## End to end (emit -> relay -> consume -> handler) p50/p99 and CPU per event at paced rates (RATES=a,b)
	@$(PY) bench/e2e_bench.py $(if $(RATES),--rates $(RATES))

bench/guard: setup ## The cost guard: relay drain, emit / INSERT, consume / hand-written loop, e2e p99 and CPU per event against BEFORE=commit, one table (ROUNDS=n; not in CI)
	@$(PY) bench/guard.py --before $(or $(BEFORE),$(error BEFORE=commit is required)) --rounds $(or $(ROUNDS),3)

bench/relay: setup ## Relay drain rate vs raw nats-py publishing, end-to-end latency, RSS (not a test)
	@$(PY) bench/relay_bench.py

bench/traces: setup ## Traces off (against BEFORE=commit, if given) and on: relay and consumer CPU per event (ROUNDS=n)
	@$(PY) bench/relay_bench.py --parts e --tracing --moderate 500,1000 --rounds $(or $(ROUNDS),3) $(if $(BEFORE),--before $(BEFORE))
	@$(PY) bench/consumer_bench.py --only i --rounds $(or $(ROUNDS),3)

docs/screenshots: setup ## Renew docs/images/console-*.png from the console's browser tests
	@CONSOLE_SCREENSHOTS=$(CURDIR)/docs/images $(PYTEST) -q tests/console/test_console_browser.py -k replays_a_group

bench/dlq: setup ## Dead-letter groups, lists and batched discard/restore vs plain SQL (not a test)
	@$(PY) bench/dlq_bench.py

bench/console: setup ## The console at 100,000 dead letters: each page's SQL, the pages, a bulk replay (PER_GROUP=n)
	@$(PY) bench/console_bench.py $(if $(PER_GROUP),--per-group $(PER_GROUP))

bench/archive: setup ## Archival throughput on a 1,000,000-row partition vs a bare JDBC read (Spark)
	@$(PY) bench/archive_bench.py

bench: bench/sql bench/relay bench/consumer bench/archive ## All benchmarks

chaos: setup ## Chaos run on the handler's default settings (PROFILE=short|long|cluster-short|cluster, SEED=n, POISON_SHARE=p, KINDS=k,k): kills, restarts, outages, foreign messages under load, then a ledger check
	@$(PY) -m chaos --profile $(or $(PROFILE),short) --seed $(or $(SEED),20261122) $(if $(POISON_SHARE),--poison-share $(POISON_SHARE)) $(if $(KINDS),--kinds $(KINDS))

clean: ## Remove the demo data folder (stops nothing but what it started)
	@$(PY) -m pgoutbox.dev.demo --stop 2>/dev/null || true
	rm -rf .data
