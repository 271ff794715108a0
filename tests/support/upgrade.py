"""Helpers for the upgrade and backup tests (tests/upgrade/): builds of
pgoutbox to run side by side (the previous release, taken from git history,
and the current checkout), its commands as real processes, a writer that
keeps a ledger of what it committed, and the ledger check against what a
fake HTTP handler received.

A build runs as `python -c LAUNCH <command>`: the launcher first prints (as a
JSON log line) the version, the schema version and the folder of the
`pgoutbox` package it imported, so that a test can prove which code a worker
ran. The previous release is exported from git (harness.releases) to a
folder put first on PYTHONPATH (ahead of the checkout's editable install),
with the same virtualenv's dependencies."""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
import psycopg

from harness import releases

ROOT = Path(__file__).resolve().parents[2]

# The release before this one: its workers must keep running while this
# release's migrations are applied, and be replaceable one at a time.
PREVIOUS_RELEASE = "0ca30af"  # release 0.2.0, schema 7

LAUNCH = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "import pgoutbox\n"
    "print(json.dumps({'launched': {'version': pgoutbox.__version__, 'schema_version': pgoutbox.SCHEMA_VERSION,"
    " 'package': str(Path(pgoutbox.__file__).resolve().parent)}}), file=sys.stderr, flush=True)\n"
    "from pgoutbox.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class Build:
    """One pgoutbox to run: `package` is its pgoutbox/ folder (what `import
    pgoutbox` must resolve to), `pythonpath` what puts it first (None: the
    checkout's own install)."""

    name: str
    package: Path
    pythonpath: Path | None
    version: str
    schema_version: int

    def env(self, **settings: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON"))}
        if self.pythonpath is not None:
            env["PYTHONPATH"] = str(self.pythonpath)
        env.update(settings)
        return env

    def run(self, *argv: str, timeout: float = 60, **settings: str) -> subprocess.CompletedProcess:
        """A one-shot command (migrate, streams, registry), checked."""
        result = subprocess.run(
            [sys.executable, "-c", LAUNCH, *argv],
            env=self.env(**settings),
            cwd=self.package.parent,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise AssertionError(
                f"{self.name} `pgoutbox {' '.join(argv)}` exited with {result.returncode}:\n{result.stdout}{result.stderr}"
            )
        launched = _launched(result.stderr)
        assert launched and Path(launched["package"]) == self.package.resolve(), (
            f"{self.name} `pgoutbox {argv[0]}` imported pgoutbox from {launched}, not {self.package}"
        )
        return result


def _launched(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith('{"launched"'):
            return json.loads(line)["launched"]
    return None


def _describe(package: Path, pythonpath: Path | None, name: str) -> Build:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, pgoutbox; print(json.dumps([pgoutbox.__version__, pgoutbox.SCHEMA_VERSION]))",
        ],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
            **({"PYTHONPATH": str(pythonpath)} if pythonpath else {}),
        },
        cwd=package.parent,
        capture_output=True,
        text=True,
        check=True,
    )
    version, schema = json.loads(probe.stdout)
    return Build(name, package, pythonpath, version, int(schema))


def current_build() -> Build:
    return _describe(ROOT / "relay" / "pgoutbox", None, "current")


def previous_release(workdir: Path, commit: str = PREVIOUS_RELEASE) -> Build:
    """The previous release's tree, from this clone's git history, made
    importable as `pgoutbox`. A clone without that commit (a shallow CI
    checkout) fails the test: the upgrade path is then untested, not fine."""
    probe = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise AssertionError(
            f"the previous release (commit {commit}) is not in this clone's history: the rolling-upgrade test "
            "needs it (clone the full history, not with `git clone --depth`)"
        )
    path = releases.export(ROOT, commit, workdir / f"pgoutbox-{commit}")
    return _describe(path / "pgoutbox", path, f"previous release ({commit})")


class Worker:
    """A `pgoutbox relay` or `pgoutbox consume` of one build, as a real
    process with its log in a file; stopped only by the PID we started."""

    def __init__(self, build: Build, command: str, name: str, log_dir: Path, **settings: str):
        self.build, self.command, self.name = build, command, name
        self.log = log_dir / f"{name}.log"
        self._settings = settings
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.started_at = self.ready_at = self.stopped_at = 0.0

    def start(self) -> Worker:
        self._out = self.log.open("ab")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, self.command],
            env=self.build.env(**self._settings),
            cwd=self.build.package.parent,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def entries(self) -> list[dict]:
        out = []
        for line in self.text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def wait_ready(self, marker: str, timeout: float = 30) -> None:
        """Until the log holds `marker` (the worker's own start-up line)."""
        deadline = time.monotonic() + timeout
        while marker not in self.text():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not started after {timeout}s:\n{self.text()[-4000:]}")
            time.sleep(0.05)
        self.ready_at = time.monotonic()

    def launched(self) -> dict | None:
        return _launched(self.text())

    def schema_versions_found(self) -> list[int]:
        return [e["schema_version"] for e in self.entries() if e.get("action") == "schema_checked"]

    def problems(self) -> list[str]:
        """Log lines at error level or above, and tracebacks."""
        bad = [f"{self.name}: {e.get('event')}" for e in self.entries() if e.get("level") in ("error", "critical")]
        if "Traceback" in self.text():
            bad.append(f"{self.name}: a traceback in {self.log}")
        return bad

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM, then the exit code (a worker that ignores it is killed and fails the test)."""
        assert self.proc is not None
        assert self.proc.poll() is None, f"{self.name} had already exited with {self.proc.returncode}"
        self.stopped_at = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop within {timeout}s of SIGTERM") from None
        finally:
            self._out.close()
        return self.returncode

    def kill(self) -> None:
        """Clean-up after a failed test; only our own PID."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:
            self._out.close()


def relay_worker(
    build: Build, name: str, log_dir: Path, database_url: str, nats_url: str, *, lease: float | None = None
) -> Worker:
    """`pgoutbox relay` on the defaults; the streams file is log_dir/streams.toml.
    `lease` (with a publish timeout of 2/3 of it) only for a test about a dead
    relay's lease, which says why."""
    timings = (
        {}
        if lease is None
        else {
            "OUTBOX_RELAY_LEASE": f"{lease:g}s",
            "OUTBOX_RELAY_PUBLISH_TIMEOUT": f"{lease * 2 / 3:g}s",
        }
    )
    return Worker(
        build,
        "relay",
        name,
        log_dir,
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_NATS_URL=nats_url,
        OUTBOX_LOG_LEVEL="INFO",
        OUTBOX_STREAMS_FILE=str(log_dir / "streams.toml"),
        OUTBOX_RELAY_NAME=name,
        OUTBOX_RELAY_HTTP_PORT="0",
        **timings,
    )


def consumer_worker(
    build: Build, name: str, log_dir: Path, database_url: str, nats_url: str, registry_file: Path
) -> Worker:
    """`pgoutbox consume` of the handlers of registry_file, on the defaults."""
    return Worker(
        build,
        "consume",
        name,
        log_dir,
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_NATS_URL=nats_url,
        OUTBOX_LOG_LEVEL="INFO",
        OUTBOX_REGISTRY_FILE=str(registry_file),
        OUTBOX_REPLAY_WORKER=name,
        OUTBOX_CONSUMER_HTTP_PORT="0",
    )


def handler_registry(build: Build, workdir: Path, name: str, url: str, subject: str, target: Path) -> Path:
    """One handler's manifest as the README gives it (name, url, subjects: every
    other line on its default), and the registry generated from it by `build`
    (each build reads the registry format it writes)."""
    manifests = workdir / "handlers"
    manifests.mkdir(exist_ok=True)
    (manifests / "check.toml").write_text(f'[[handler]]\nname = "{name}"\nurl = "{url}"\nsubjects = ["{subject}"]\n')
    build.run("registry", "generate", "--manifest-dir", str(manifests), "--registry-file", str(target))
    return target


def start_worker(worker: Worker) -> Worker:
    """Starts it and waits for its own start-up line."""
    worker.start()
    worker.wait_ready('"action": "started"' if worker.command == "relay" else '"consumer started"')
    return worker


@dataclass
class Ledger:
    committed: dict[str, float] = field(default_factory=dict)  # event id -> monotonic commit time
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Writer(threading.Thread):
    """The application: one outbox.emit per transaction at `rate` per second,
    recording each event id with the time its commit returned. The emit is
    the SQL API of every release (expand-only migrations keep it).

    `backlog` (with `most`): how many committed events are still on their way
    to the handler; the writer pauses while there are `most` or more. A fixed
    rate that the machine cannot keep up with (a 2-core machine under other load
    delivered about 10 of the 50 events/s) builds a backlog without
    bound, and a step that waits for the events committed after it waits for
    all of it. `held`: the seconds spent paused."""

    def __init__(
        self,
        url: str,
        ledger: Ledger,
        *,
        rate: float = 40,
        context: str = "sea",
        name: str = "writer",
        backlog: Callable[[], int] | None = None,
        most: int = 0,
    ):
        super().__init__(daemon=True, name=name)
        self.url, self.ledger, self.interval, self.context = url, ledger, 1.0 / rate, context
        self.backlog, self.most = backlog, most
        self.halt = threading.Event()
        self.held = 0.0

    def _paused(self) -> bool:
        """Pauses while the backlog is at its bound (pacing, not a wait for an event to assert on)."""
        if self.backlog is None or self.backlog() < self.most:
            return False
        since = time.monotonic()
        while self.backlog() >= self.most and not self.halt.wait(0.05):
            pass
        self.held += time.monotonic() - since
        return True

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        n = 0
        next_at = time.monotonic()
        while not self.halt.is_set():
            next_at += self.interval
            time.sleep(max(0.0, next_at - time.monotonic()))
            if self._paused():
                next_at = time.monotonic()  # the rate again from now, not a burst to catch up
            if self.halt.is_set():
                break
            n += 1
            try:
                conn = conn or psycopg.connect(self.url, autocommit=True, connect_timeout=3)
                row = conn.execute(
                    "SELECT outbox.emit('order', %s, 'order_created', jsonb_build_object('schema_version', 1, 'n', %s),"
                    " context => %s)",
                    (f"{self.name}-{n}", n, self.context),
                ).fetchone()
            except psycopg.Error as exc:
                with self.ledger.lock:
                    self.ledger.errors.append(f"{type(exc).__name__} [{exc.sqlstate}]: {exc}")
                conn = None
                continue
            assert row is not None
            with self.ledger.lock:
                self.ledger.committed[str(row[0])] = time.monotonic()
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


@dataclass(frozen=True)
class Delivery:
    """What the handler received, per event id: its calls' times."""

    calls: dict[str, list[float]]

    @classmethod
    def of(cls, handler) -> Delivery:
        calls: dict[str, list[float]] = {}
        for c in list(handler.calls):
            calls.setdefault(c.message_id, []).append(c.at)
        return cls(calls)

    def first(self, event_id: str) -> float | None:
        times = self.calls.get(event_id)
        return min(times) if times else None


def delivered_since(ledger: Ledger, handler, since: float, n: int = 10):
    """A predicate for wait_for: n events committed after `since` (monotonic) have
    reached the handler, i.e. the workers running now deliver."""

    def check() -> bool:
        with ledger.lock:
            after = [e for e, at in ledger.committed.items() if at > since]
        calls = Delivery.of(handler).calls
        return sum(1 for e in after if e in calls) >= n

    return check


def acked_everything(nats_url: str, durable: str, stream: str = "SEA_EVENTS") -> bool:
    """The durable's ack floor is the stream's last message, nothing pending:
    no delivery can come any more, so a duplicate call would have shown."""

    async def read() -> bool:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            last = (await js.stream_info(stream)).state.last_seq
            info = await js.consumer_info(stream, durable)
            return info.ack_floor.stream_seq == last and info.num_ack_pending == 0 and info.num_pending == 0
        finally:
            await nc.close()

    return asyncio.run(read())


def ledger_problems(ledger: Ledger, delivered: Delivery) -> list[str]:
    """Nothing lost (every committed event reached the handler), nothing
    processed twice (one call per event id), nothing invented."""
    out = []
    lost = [e for e in ledger.committed if e not in delivered.calls]
    if lost:
        out.append(f"{len(lost)} committed event(s) never reached the handler, e.g. {lost[:3]}")
    twice = {e: len(t) for e, t in delivered.calls.items() if len(t) > 1}
    if twice:
        out.append(f"{len(twice)} event(s) handled more than once: {dict(list(twice.items())[:5])}")
    unknown = [e for e in delivered.calls if e not in ledger.committed]
    if unknown:
        out.append(f"{len(unknown)} handled event(s) the writers never committed, e.g. {unknown[:3]}")
    if ledger.errors:
        out.append(f"{len(ledger.errors)} emit(s) failed: {Counter(ledger.errors).most_common(3)}")
    return out


def latencies(ledger: Ledger, delivered: Delivery, start: float, end: float) -> list[float]:
    """Commit -> first handler call, for the events committed in [start, end)."""
    out = []
    for event_id, at in ledger.committed.items():
        first = delivered.first(event_id)
        if start <= at < end and first is not None:
            out.append(first - at)
    return out


def longest_silence(delivered: Delivery, start: float, end: float) -> float:
    """The longest stretch within [start, end] with no handler call."""
    times = sorted(t for ts in delivered.calls.values() for t in ts if start <= t <= end)
    marks = [start, *times, end]
    return max(b - a for a, b in zip(marks, marks[1:]))


def summary(values: list[float]) -> str:
    if not values:
        return "no events"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (
        f"{len(values)} events, p50 {statistics.median(values) * 1000:.0f} ms, "
        f"p99 {p99 * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms, {sum(v > 1 for v in values)} over 1 s"
    )


def schema_version(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT outbox.schema_version()").fetchone()
    assert row is not None
    return int(row[0])


# -- backup and restore ----------------------------------------------------------


def dump_and_restore(pg_bin: Path, source_url: str, target_url: str, fmt: str, workdir: Path) -> None:
    """pg_dump of source in `fmt` ("plain": an SQL script replayed with psql;
    "custom": an archive read by pg_restore, two jobs in parallel) into target, an empty database of
    the same cluster (roles are cluster-wide: the dump refers to them)."""
    if fmt == "plain":
        script = workdir / "backup.sql"
        _tool(pg_bin, "pg_dump", "--format=plain", f"--file={script}", "-d", source_url)
        _tool(pg_bin, "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", str(script), "-d", target_url)
    elif fmt == "custom":
        archive = workdir / "backup.dump"
        _tool(pg_bin, "pg_dump", "--format=custom", f"--file={archive}", "-d", source_url)
        _tool(pg_bin, "pg_restore", "--exit-on-error", "--jobs=2", "-d", target_url, str(archive))
    else:
        raise ValueError(fmt)


def _tool(pg_bin: Path, name: str, *args: str) -> None:
    result = subprocess.run([str(pg_bin / name), *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0 or "ERROR" in result.stderr or "WARNING" in result.stderr:
        raise AssertionError(f"{name} {' '.join(args)} exited with {result.returncode}:\n{result.stderr[-4000:]}")


def schema_catalog(pg_bin: Path, url: str) -> str:
    """The schema as pg_dump prints it (owners and grants included), without
    the per-dump random \\restrict key."""
    dump = subprocess.run(
        [str(pg_bin / "pg_dump"), "--schema-only", "-d", url], check=True, capture_output=True, text=True
    ).stdout
    lines = [line for line in dump.splitlines() if not line.startswith(("\\restrict", "\\unrestrict"))]
    # A restore re-parses trigger conditions: PostgreSQL then prints a chain
    # of ORs built nested (`((a OR b) OR c)`) flat (`(a OR b OR c)`), the same
    # expression. Compared without their parentheses.
    return "\n".join(
        line.replace("(", "").replace(")", "") if line.startswith("CREATE TRIGGER") else line for line in lines
    )


def differences(before: str, after: str, limit: int = 60) -> str:
    """A unified diff of two texts (empty: equal), cut to `limit` lines."""
    lines = list(difflib.unified_diff(before.splitlines(), after.splitlines(), "source", "restored", lineterm="", n=1))
    return "\n".join(lines[:limit])


def contents(url: str) -> dict[str, str]:
    """Every table of the outbox and inbox schemas (partitions one by one),
    as a digest of its rows, and every sequence's state."""
    out: dict[str, str] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class AS c"
            " INNER JOIN pg_namespace AS n ON c.relnamespace = n.oid"
            " WHERE n.nspname IN ('outbox', 'inbox') AND c.relkind = 'r' ORDER BY 1"
        ).fetchall()
        for (table,) in tables:
            row = conn.execute(
                f"SELECT count(*), md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM {table} AS t"
            ).fetchone()
            out[table] = f"{row[0]} rows, md5 {row[1]}" if row else "?"
        for name, last, called in conn.execute(
            "SELECT format('%I.%I', schemaname, sequencename), last_value, last_value IS NOT NULL"
            " FROM pg_sequences WHERE schemaname IN ('outbox', 'inbox') ORDER BY 1"
        ).fetchall():
            out[name] = f"sequence at {last} ({'used' if called else 'unused'})"
    return out
