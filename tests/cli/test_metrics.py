"""What the workers serve on /metrics passes `promtool check metrics` (the
exposition parses, and the linter has nothing to say), and every name is
pgoutbox_*.

A real `pgoutbox relay` and a real `pgoutbox consume` run on their defaults
(only the HTTP port is any free one), each as a login in the role
docs/reference.md gives it, with traffic through both: events emitted, published
by the relay (one to a context without a stream, dead-lettered), handled by the
consumer (one answered 422, dead-lettered), so that the labelled series exist.

The 0.4.0 section of docs/upgrading.md renames to exactly the names served, and
its metric_relabel_configs give every old series its new name (applied here as
Prometheus applies them; promtool checks the config's syntax).

promtool comes from scripts/bootstrap.sh (`make setup`) into .venv/bin; without
it the tests that need it fail and say so."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg.types.json import Jsonb

from support.inbox import FakeHandler
from support.outbox import apply_streams, status_counts, wait_for
from support.workers import worker

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PGOUTBOX = BIN / "pgoutbox"
HANDLER = "billing"
SUBJECT = "sea.event.order_created.v1"


@pytest.fixture(scope="module")
def promtool() -> Path:
    found = BIN / "promtool" if (BIN / "promtool").exists() else shutil.which("promtool")
    if not found:
        pytest.fail(f"promtool is missing from {BIN}: run `make setup` (scripts/bootstrap.sh fetches it)")
    return Path(found)


def check_metrics(promtool: Path, text: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


def documented_role(command: str) -> str:
    """The one role the command-roles table of docs/reference.md gives the command."""
    table = (ROOT / "docs" / "reference.md").read_text()
    [row] = re.findall(rf"^\| `pgoutbox {command}` \|(.*)\|$", table, re.M)
    [role] = re.findall(r"`(pgoutbox_[a-z]+)`", row)
    return role


@pytest.fixture
def login(pg_server, database_url):
    """login(role) -> the database URL of a fresh LOGIN role that is a member of that role only."""
    made: list[str] = []

    def make(role: str) -> str:
        name = f"t_metrics_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            conn.execute(
                psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    psycopg.sql.Identifier(name), psycopg.sql.Identifier(role)
                )
            )
        made.append(name)
        url = database_url.replace("postgresql://postgres@", f"postgresql://{name}@", 1)
        assert url != database_url
        return url

    yield make
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        for name in made:
            conn.execute(psycopg.sql.SQL("DROP ROLE IF EXISTS {}").format(psycopg.sql.Identifier(name)))


@contextlib.contextmanager
def both_workers(tmp_path: Path, nats_server, login, handler: FakeHandler) -> Iterator[tuple[int, int]]:
    """A consumer (one handler on SUBJECT) and a relay, each as its documented
    role, on the defaults but for /metrics on a free port: (consumer, relay) ports."""
    (tmp_path / "handlers").mkdir()
    (tmp_path / "handlers" / "billing.toml").write_text(
        f'[[handler]]\nname = "{HANDLER}"\nurl = "{handler.url}"\nsubjects = ["{SUBJECT}"]\n'
    )
    subprocess.run([str(PGOUTBOX), "registry", "generate"], cwd=tmp_path, check=True, capture_output=True)
    asyncio.run(apply_streams(nats_server.url))
    common = {"OUTBOX_NATS_URL": nats_server.url}
    with (
        worker(
            tmp_path,
            "consume",
            '"consumer started"',
            **common,
            OUTBOX_DATABASE_URL=login(documented_role("consume")),
            OUTBOX_CONSUMER_HTTP_PORT="0",
        ) as consumer_port,
        worker(
            tmp_path,
            "relay",
            '"action": "started"',
            **common,
            OUTBOX_DATABASE_URL=login(documented_role("relay")),
            OUTBOX_RELAY_HTTP_PORT="0",
        ) as relay_port,
    ):
        assert consumer_port and relay_port
        yield consumer_port, relay_port


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def names(text: str) -> set[str]:
    """Every metric name the exposition mentions: families and samples."""
    found = set(re.findall(r"^# (?:HELP|TYPE) (\w+)", text, re.M))
    return found | set(re.findall(r"^(\w+)[{ ]", text, re.M))


def emit(url: str, context: str, answers: list) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "SELECT outbox.emit('order', '1', 'order_created', %s, context => %s)",
            (Jsonb({"schema_version": 1, "answers": answers}), context),
        )


def inbox_statuses(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM inbox.messages GROUP BY 1").fetchall())


def test_promtool_finds_what_it_should(promtool):
    """So that a clean check below means something: promtool refuses a
    counter without `_total` and a malformed line."""
    bad = "# HELP jobs Jobs done\n# TYPE jobs counter\njobs 1\n"
    done = check_metrics(promtool, bad)
    assert done.returncode != 0 and "_total" in done.stdout + done.stderr, done
    assert check_metrics(promtool, "# TYPE x gauge\nx{a=} 1\n").returncode != 0
    good = "# HELP jobs_total Jobs done\n# TYPE jobs_total counter\njobs_total 1\n"
    done = check_metrics(promtool, good)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_both_workers_metrics_pass_promtool(promtool, database_url, nats_server, login, tmp_path):
    handler = FakeHandler()
    try:
        with both_workers(tmp_path, nats_server, login, handler) as (consumer_port, relay_port):
            for answers in ([200], [200], [422]):
                emit(database_url, "sea", answers)
            emit(database_url, "nowhere", [200])  # no stream captures it: dead-lettered by the relay
            wait_for(lambda: status_counts(database_url) == {"COMPLETED": 3, "DEAD_LETTER": 1}, 60, "the relay")
            wait_for(lambda: inbox_statuses(database_url) == {"PROCESSED": 2, "DEAD_LETTER": 1}, 60, "the consumer")
            # The backlog gauges are refreshed every OUTBOX_*_BACKLOG_INTERVAL (5 s and 15 s by default).
            expected = {
                relay_port: (
                    'pgoutbox_relay_published_events_total{context="sea"} 3.0',
                    'pgoutbox_relay_dead_lettered_events_total{code="NO_STREAM",context="nowhere"} 1.0',
                    'pgoutbox_outbox_dead_letter_events{context="nowhere"} 1.0',
                    "pgoutbox_relay_ready 1.0",
                ),
                consumer_port: (
                    f'pgoutbox_consumer_messages_total{{handler="{HANDLER}",outcome="processed"}} 2.0',
                    f'pgoutbox_consumer_messages_total{{handler="{HANDLER}",outcome="dead_lettered"}} 1.0',
                    f'pgoutbox_inbox_backlog_messages{{context="sea",handler="{HANDLER}",kind="dead_letter"}} 1.0',
                ),
            }
            for port, lines in expected.items():
                wait_for(
                    lambda p=port, ls=lines: all(x in scrape(p).splitlines() for x in ls), 40, f"{lines} on :{port}"
                )
            texts = {"relay": scrape(relay_port), "consume": scrape(consumer_port)}
    finally:
        handler.close()

    for command, text in texts.items():
        done = check_metrics(promtool, text)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), f"pgoutbox {command}:\n{done}\n{text}"
        foreign = sorted(n for n in names(text) if not n.startswith("pgoutbox_"))
        assert foreign == [], f"pgoutbox {command} serves {foreign}"


# -- docs/upgrading.md: the 0.4.0 renames -----------------------------------------

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def upgrading_section() -> str:
    text = (ROOT / "docs" / "upgrading.md").read_text()
    m = re.search(r"^## 0\.4\.0: metric names\n(.*?)^## ", text, re.S | re.M)
    assert m, "docs/upgrading.md has no section `## 0.4.0: metric names`"
    return m.group(1)


def renames() -> list[tuple[str | None, str, str]]:
    """(old, new, type) of each row of the rename table; old is None for a metric new in 0.4.0."""
    rows = re.findall(
        r"^\| (?:`(\w+)`|\*\(new\)\*) \| (?:`(\w+)`|\*\(unchanged\)\*) \| (\w+) \|$", upgrading_section(), re.M
    )
    return [(old or None, new or old, kind) for old, new, kind in rows]


def relabel(name: str) -> str:
    """__name__ after the section's metric_relabel_configs, as Prometheus applies
    them: each rule in turn, its regex anchored, ${n} replaced by the group."""
    [block] = re.findall(r"```yaml\n(.*?)```", upgrading_section(), re.S)
    rules = re.findall(r"regex: (\S+)\n\s+target_label: __name__\n\s+replacement: (\S+)", block)
    assert len(rules) == block.count("- source_labels: [__name__]") > 0
    for regex, replacement in rules:
        m = re.fullmatch(regex, name)
        if m:
            name = re.sub(r"\$\{(\d+)\}", lambda g, m=m: m.group(int(g.group(1))), replacement)
    return name


def series(name: str, kind: str) -> list[str]:
    base = name.removesuffix("_total") if kind == "counter" else name
    return [base + suffix for suffix in SUFFIXES[kind]]


def test_the_rename_table_ends_at_exactly_the_metrics_the_workers_serve():
    from pgoutbox.cli import main as cli
    from pgoutbox.core import health

    served = {(name, kind) for m in cli.all_metrics().values() for name, kind, _, _ in health.families(m)}
    assert {(new, kind) for _, new, kind in renames()} == served
    assert len(renames()) == len(served)


def test_the_relabel_rules_give_every_old_series_its_new_name():
    for old, new, kind in renames():
        for before, after in zip(series(old or new, kind), series(new, kind), strict=True):
            assert relabel(before) == after, before
            assert relabel(after) == after, after


def test_promtool_accepts_the_scrape_config(promtool, tmp_path):
    [block] = re.findall(r"```yaml\n(.*?)```", upgrading_section(), re.S)
    path = tmp_path / "prometheus.yml"
    path.write_text(block)
    done = subprocess.run([str(promtool), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done


# -- deploy/: the Prometheus rules and the Grafana dashboard ----------------------

RULES = ROOT / "deploy" / "prometheus" / "pgoutbox.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "pgoutbox.json"
AGE_AT_PUBLISH = "pgoutbox_relay_event_age_at_publish_seconds"
AGE_AT_OUTCOME = "pgoutbox_consumer_event_age_at_outcome_seconds"


def expressions() -> dict[str, str]:
    """Where -> PromQL, for every expression of the rules file and the dashboard."""
    found = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            found[f"rules: {rule.get('record') or rule.get('alert')}"] = rule["expr"]
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            found[f"dashboard: {panel['title']} {target['refId']}"] = target["expr"]
    return found


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample's value in an exposition, or None."""
    shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{shown}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_promtool_accepts_the_rules_file(promtool):
    done = subprocess.run([str(promtool), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "SUCCESS: 29 rules found" in done.stdout, done


def test_the_rules_compute_the_kpis_and_fire_the_alerts_promtool_unit_tests_expect(promtool):
    """deploy/prometheus/pgoutbox.rules.test.yml: a slow handler alerts and a
    fast one does not, the KPI ratios of known counts, a relay without
    progress and a growing backlog alert (with two relays reporting it), and
    the PRD's targets at their edges (DLQ 0.09 % and 0.11 %, delivery 99.98 %)."""
    tests = RULES.with_name("pgoutbox.rules.test.yml")
    done = subprocess.run(
        [str(promtool), "test", "rules", tests.name], cwd=tests.parent, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done
    # Each alert of the rules file has a test that makes it fire or says why not.
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for case in yaml.safe_load(tests.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested <= alerts and len(tested) >= 4, tested


def test_the_rules_and_the_dashboard_use_only_recorded_rules_and_declared_labels():
    """The names and labels each expression uses, against what the workers
    declare (the served names are checked with traffic below): a label in
    `by`/`on`/a matcher that none of the expression's metrics has would
    silently aggregate everything into one series."""
    from pgoutbox.cli import main as cli
    from pgoutbox.core import health

    labels = {
        name.removesuffix("_total"): set(names) | ({"le"} if kind == "histogram" else set())
        for m in cli.all_metrics().values()
        for name, kind, names, _ in health.families(m)
    }
    recorded = {
        rule["record"]: rule["expr"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
    exprs = expressions()
    assert len([k for k in exprs if k.startswith("dashboard")]) >= 15
    # The dashboard imports as it is: unique panel ids, panels within the 24-column grid,
    # every query on the data source variable it declares.
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    assert {t["datasource"]["uid"] for p in panels for t in p.get("targets", [])} == {"${datasource}"}
    for where, expr in exprs.items():
        for rule in re.findall(r"\bpgoutbox:[\w:]+", expr):
            assert rule in recorded, f"{where}: {rule} is no recording rule of {RULES.name}"
        # The metrics and the recorded rules' own metrics: their labels are the expression's.
        expanded = expr + " ".join(recorded[r] for r in re.findall(r"\bpgoutbox:[\w:]+", expr))
        used = {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in re.findall(r"\bpgoutbox_\w+", expanded)}
        assert used, f"{where}: no pgoutbox metric"
        unknown = sorted(n for n in used if n not in labels)
        assert not unknown, f"{where}: {unknown} are not metrics the workers declare"
        have = set().union(*(labels[n] for n in used)) | {"instance", "job", "__name__"}
        said = set(re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr))
        said = {label.strip() for group in said for label in group.split(",") if label.strip()}
        said |= set(re.findall(r"[{,]\s*(\w+)\s*(?:=~|!=|=)", expr))
        assert said <= have, f"{where}: labels {sorted(said - have)} belong to none of {sorted(used)}"
    # docs/observability.md names only these rules and declared metrics.
    doc = (ROOT / "docs" / "observability.md").read_text()
    assert set(re.findall(r"\bpgoutbox:[\w:]+", doc)) <= set(recorded)
    documented = {
        re.sub(r"_(bucket|count|sum|total)$", "", n)
        for n in re.findall(r"\bpgoutbox_\w+", doc)
        if not n.endswith("_")  # pgoutbox_outbox_*: a family of names
    }
    assert documented <= set(labels), sorted(documented - set(labels))


def test_the_dashboard_and_rules_metrics_are_served_and_the_ages_observe_every_event(
    database_url, nats_server, login, tmp_path
):
    """A real relay and consumer with traffic: each pgoutbox_* name of the
    rules and the dashboard is on one of the two /metrics, and both age
    histograms observed every event, with ages no longer than the run."""
    handler = FakeHandler()
    events = 5
    try:
        with both_workers(tmp_path, nats_server, login, handler) as (consumer_port, relay_port):
            started = time.time()
            for _ in range(events):
                emit(database_url, "sea", [200])
            wait_for(lambda: inbox_statuses(database_url) == {"PROCESSED": events}, 60, "the consumer")
            counted = (consumer_port, f'{AGE_AT_OUTCOME}_count{{handler="{HANDLER}",outcome="processed"}} {events}.0')
            wait_for(lambda: counted[1] in scrape(counted[0]).splitlines(), 30, counted[1])
            ran = time.time() - started
            relay_text, consumer_text = scrape(relay_port), scrape(consumer_port)
    finally:
        handler.close()

    served = names(relay_text) | names(consumer_text)
    for where, expr in expressions().items():
        missing = sorted(set(re.findall(r"\bpgoutbox_\w+", expr)) - served)
        assert not missing, f"{where} uses {missing}, which neither /metrics serves"

    assert sample(relay_text, f"{AGE_AT_PUBLISH}_count", context="sea") == events
    at_publish = sample(relay_text, f"{AGE_AT_PUBLISH}_sum", context="sea")
    assert sample(consumer_text, f"{AGE_AT_OUTCOME}_count", handler=HANDLER, outcome="processed") == events
    at_outcome = sample(consumer_text, f"{AGE_AT_OUTCOME}_sum", handler=HANDLER, outcome="processed")
    # Same host, same clock: each event was older at its outcome than at its publish.
    # not a race: the upper bound is the time measured around the run, not a fixed one
    assert 0 < at_publish <= at_outcome <= events * ran, (at_publish, at_outcome, ran)
    assert sample(consumer_text, "pgoutbox_consumer_handler_calls_total", handler=HANDLER, answer="ok") == events
    assert sample(consumer_text, f"{AGE_AT_OUTCOME}_bucket", handler=HANDLER, outcome="processed", le="+Inf") == events
