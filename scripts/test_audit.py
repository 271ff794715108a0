#!/usr/bin/env python3
"""Audits the test suite against its own rules and prints a table of
its findings: the figures when the audit was written, and now.

    python scripts/test_audit.py            # the table
    python scripts/test_audit.py --list     # every finding, one a line
    python scripts/test_audit.py --check    # exit 1 on a finding not in tests/audit_baseline.txt

What it reads (static, AST and text; nothing runs):

- defaults: settings the shared helpers (tests/support/*.py) or a test set to
  a value other than the default of docs/reference.md's settings table. A
  change is allowed with its reason, one line: a comment `# not default: <why>`
  on its line or on the comment lines right above it. Addresses (URLs, files,
  names, ports) are not behaviour and are not counted.
- roles: commands under test (a relay or consumer config, a relay or consumer
  process, OUTBOX_DATABASE_URL of a subprocess) given the superuser's database
  URL (the `database_url` / `empty_database_url` fixtures, `*.dsn(...)`) where
  docs/reference.md names a pgoutbox role for the command. Setup (psycopg
  connections) is not a command. `# as owner: <why>` on the line exempts one.
- pgTAP: pgtap/*.sql files that call a function the roles table grants and
  never `SET [LOCAL] ROLE` (or SESSION AUTHORIZATION) to a role. `-- as owner: <why>`
  in the file exempts it (a file about the catalog, the owner's view).
- races: in test files, a sleep followed by an assert in the same block
  (sleep-then-assert), and an assert that compares a clock reading
  (wall-clock bound). `# not a race: <why>` on the line exempts one.
- cannot fail: property tests (@given) without an assert.
- cluster fault kinds: the kinds of chaos/ that tests/chaos/test_cluster_faults.py
  does not run.

--check fails on a finding that tests/audit_baseline.txt does not list (the
ones that were there when the audit came): a new test keeps the rules, old
ones leave the baseline as they are fixed (--write-baseline rewrites it).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
BASELINE = TESTS / "audit_baseline.txt"

DEFAULT_MARK = "# not default:"
OWNER_MARK = "# as owner:"
RACE_MARK = "# not a race:"
SQL_OWNER_MARK = "-- as owner:"

# The audit's table, and the figures this script gave on main when it was written.
ROWS = [
    ("helper", "test functions run through shared helpers that change defaults"),
    ("setting", "settings a test changes without a `# not default:` reason"),
    ("superuser", "test functions that run a command as the superuser where docs/reference.md gives a role"),
    ("pgtap", "pgTAP files that test an API and never SET ROLE to a pgoutbox role"),
    ("race", "sleep-then-assert and wall-clock bounds in tests"),
    ("cannot-fail", "property tests that assert nothing"),
    ("cluster-kind", "cluster fault kinds never run under the ledger"),
]
# `--root` on `git archive 1f20f9b` (main when written); a count by hand read 91, 19, 122 + 12, 14 of 22, 34, 7, 4
BEFORE = {
    "helper": 92,
    "setting": 93,
    "superuser": 75,
    "pgtap": 13,
    "race": 40,
    "cannot-fail": 2,
    "cluster-kind": 0,
}

# Where, not how: a test must pick its own (free ports, its own servers and files).
ADDRESSES = {
    "database_url",
    "nats_url",
    "registry_file",
    "streams_file",
    "relay_name",
    "replay_worker",
    "http_host",
    "http_port",
    "host",
    "port",
    "nats_monitor_url",
    "archive_uri",
    "report_uri",
    "state_file",
    "metrics_file",
    "spill_dir",
    "name",
    "url",
    "subjects",
    "stream",
    "handler",
    "handlers",
}
# Handler manifest keys (registry TOML) that are settings under another name.
MANIFEST = {"timeout": "handler_timeout"}

# Commands under test, and where their database URL goes: (positional index, keyword).
ENTRY_POINTS = {
    "relay_config": ("relay", 0, "database_url"),
    "RelayProcess": ("relay", 2, "database_url"),
    "consumer_config": ("consume", 0, "database_url"),
    "default_consumer_config": ("consume", 0, "database_url"),
    "relay_worker": ("relay", 3, "database_url"),
    "consumer_worker": ("consume", 3, "database_url"),
}
SUPERUSER_NAMES = {"database_url", "empty_database_url", "su", "superuser_url"}

LOGS_IN: set[str] = set()
CLUSTER_KINDS = ("kill_nats_node", "rolling_restart_nats", "partition_nats_node", "pg_failover")


@dataclass(frozen=True)
class Finding:
    kind: str
    where: str  # path::function (or path)
    what: str

    def key(self) -> str:
        return f"{self.kind} {self.where} {self.what}"


# -- docs/reference.md ---------------------------------------------------------


def _duration(text: str) -> float | None:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", text)
    if not m:
        return None
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m.group(2)]
    return float(m.group(1)) * scale


def same_value(a: str, b: str) -> bool:
    a, b = a.strip().strip("`").lower(), b.strip().strip("`").lower()
    if a == b:
        return True
    da, db = _duration(a), _duration(b)
    return da is not None and da == db


def documented_settings(reference: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(env var -> default, field name -> its defaults over the commands)."""
    by_env: dict[str, str] = {}
    by_field: dict[str, set[str]] = {}
    block = reference.split("<!-- settings:begin -->", 1)[1].split("<!--", 1)[0]
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`OUTBOX_"):
            continue
        env, flag, default = cells[0].strip("`"), cells[1], cells[2]
        default = "" if default.startswith("*(") else default.strip("`")
        by_env[env] = default
        m = re.match(r"`--([a-z0-9-]+)`", flag)
        if m:
            by_field.setdefault(m.group(1).replace("-", "_"), set()).add(default)
    return by_env, by_field


def command_roles(reference: str) -> dict[str, str | None]:
    """`pgoutbox <command>` -> its pgoutbox role (None: no database role or the owner)."""
    block = reference.split("<!-- command-roles:begin -->", 1)[1].split("<!-- command-roles:end -->", 1)[0]
    out: dict[str, str | None] = {}
    for line in block.splitlines():
        m = re.match(r"\|\s*`pgoutbox ([a-z-]+)`\s*\|\s*(.*)\|", line)
        if m:
            role = re.match(r"`(pgoutbox_[a-z]+)`", m.group(2).strip())
            out[m.group(1)] = role.group(1) if role else None
    return out


def granted_functions(reference: str) -> set[str]:
    """Function names the roles table grants to some pgoutbox role."""
    names: set[str] = set()
    for line in reference.splitlines():
        if line.startswith("| `pgoutbox_") and line.count("|") >= 4:
            names.update(re.findall(r"`(?:outbox\.|inbox\.)?([a-z_]+)`", line.split("|")[2]))
    return names - {"pgoutbox"}


# -- source helpers --------------------------------------------------------------


def marked(lines: list[str], lineno: int, mark: str, last: int | None = None) -> bool:
    """The mark on the lines lineno..last (1-based: a statement), or in the comment
    lines right above them."""
    if any(mark in line for line in lines[lineno - 1 : (last or lineno)]):
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        if mark in lines[i]:
            return True
        i -= 1
    return False


def simple_statements(tree: ast.AST) -> list[tuple[int, int]]:
    """The line spans of the simple statements (no body) in tree."""
    return [
        (node.lineno, node.end_lineno or node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt) and not hasattr(node, "body")
    ]


def statement(spans: list[tuple[int, int]], line: int) -> tuple[int, int]:
    """The lines of the innermost simple statement holding `line` (a call over
    several lines takes its reason anywhere in it, or right above it)."""
    holding = [(a, b) for a, b in spans if a <= line <= b]
    return min(holding, key=lambda ab: ab[1] - ab[0]) if holding else (line, line)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _const(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool)):
        return str(node.value)
    return None


def _changes(tree: ast.AST) -> list[tuple[ast.AST, str, str, int]]:
    """(enclosing node, setting, value, line) of every constant given to a setting:
    dict entries and keywords named like a setting, OUTBOX_* keys, manifest lines."""
    found = []
    for node in ast.walk(tree):
        pairs: list[tuple[str, ast.AST, int]] = []
        if isinstance(node, ast.Dict):
            keys = {_const(k) for k in node.keys}
            config = bool(keys & {"database_url", "nats_url", "url"})  # a config's or a manifest's values
            pairs += [
                (k.value, v, k.lineno)
                for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant)
                and isinstance(k.value, str)
                and (config or k.value.startswith("OUTBOX_"))
            ]
        elif isinstance(node, ast.Call) and _is_config_call(node):
            pairs += [(kw.arg, kw.value, kw.value.lineno) for kw in node.keywords if kw.arg]
        for key, value, line in pairs:
            v = _const(value)
            if v is not None:
                found.append((node, key, v, line))
    return found


def _is_config_call(node: ast.Call) -> bool:
    """A call that builds a command's settings: the support helpers, settings.build/load,
    a worker or process (keywords are OUTBOX_* variables or settings)."""
    name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
    return (
        name in ENTRY_POINTS or name in {"build", "load", "serving", "Worker"} or name.endswith(("_config", "Process"))
    )


def _manifest_changes(source: str) -> list[tuple[str, str, int]]:
    out = []
    for i, line in enumerate(source.splitlines(), 1):
        for key, value in re.findall(r"(?:\\n|^|\"|')([a-z_]+) = \\?\"?([0-9][0-9.]*[a-z]*)", line):
            out.append((MANIFEST.get(key, key), value, i))
    return out


class Audit:
    def __init__(self) -> None:
        reference = (ROOT / "docs" / "reference.md").read_text()
        self.by_env, self.by_field = documented_settings(reference)
        self.roles = command_roles(reference)
        self.granted = granted_functions(reference)
        self.findings: list[Finding] = []

    # a setting changed: None when it is a default or an address
    def changed(self, key: str, value: str) -> bool | None:
        if key.startswith("OUTBOX_"):
            if key not in self.by_env:
                return None
            field = None
            defaults = {self.by_env[key]}
            for f in self.by_field:
                if key.endswith("_" + f.upper()):
                    field = f
            if field in ADDRESSES or key.endswith(("_URL", "_FILE", "_PORT", "_HOST", "_NAME", "_WORKER", "_URI")):
                return None
        else:
            if key in ADDRESSES or key not in self.by_field:
                return None
            defaults = self.by_field[key]
        if not any(defaults) or any(d in ("", "none") for d in defaults):
            return None  # an input with no default (a reason, a target, a filter)
        if any(same_value(value, d) for d in defaults):
            return False
        return True

    def setting_changes(self, path: Path, source: str, tree: ast.AST) -> list[tuple[str, str, int]]:
        lines = source.splitlines()
        out = []
        seen = set()
        spans = simple_statements(tree)
        for _, key, value, line in _changes(tree):
            if (
                self.changed(key, value)
                and not marked(lines, *statement(spans, line)[:1], DEFAULT_MARK, statement(spans, line)[1])
                and (key, line) not in seen
            ):
                seen.add((key, line))
                out.append((key, value, line))
        lo, hi = getattr(tree, "lineno", 1), getattr(tree, "end_lineno", None) or len(lines)
        for key, value, line in _manifest_changes(source):
            if (
                lo <= line <= hi
                and self.changed(key, value)
                and not marked(lines, line, DEFAULT_MARK)
                and (key, line) not in seen
            ):
                seen.add((key, line))
                out.append((key, value, line))
        return out

    # -- rows 1 and 2 --------------------------------------------------------------

    def defaults(self) -> None:
        tainted: set[str] = set()  # support names whose settings change a default without a reason
        for path in sorted((TESTS / "support").glob("*.py")):
            source = path.read_text()
            tree = ast.parse(source)
            for top in tree.body:
                if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    changes = self.setting_changes(path, source, top)
                    if changes:
                        tainted.add(top.name)
                        for key, value, _line in changes:
                            self.findings.append(
                                Finding("helper-setting", f"{rel(path)}::{top.name}", f"{key}={value}")
                            )
        for path, tree, source in self.test_modules():
            local = set(tainted)
            functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            names = {id(f): _names(f) for f in functions}
            for _ in range(3):  # module helpers and fixtures that call a tainted helper
                for f in functions:
                    if not f.name.startswith("test_") and names[id(f)] & local:
                        local.add(f.name)
            for f in functions:
                if not f.name.startswith("test_"):
                    continue
                params = {a.arg for a in f.args.args} if not isinstance(f, ast.ClassDef) else set()
                used = (names[id(f)] | params) & local
                if used:
                    self.findings.append(Finding("helper", f"{rel(path)}::{f.name}", ",".join(sorted(used))))
            for key, value, line in self.setting_changes(path, source, tree):
                self.findings.append(Finding("setting", f"{rel(path)}::{_enclosing(tree, line)}", f"{key}={value}"))

    # -- row 3 ---------------------------------------------------------------------

    def superuser(self) -> None:
        # Helpers that log in as the command's role themselves (support.roles.as_role):
        # only their as_owner= argument runs the command as the owner.
        global LOGS_IN
        LOGS_IN = set()
        for path in sorted((TESTS / "support").glob("*.py")):
            for top in ast.parse(path.read_text()).body:
                if (
                    isinstance(top, ast.FunctionDef | ast.ClassDef)
                    and "as_role" in _names(top)
                    and top.name in ENTRY_POINTS
                ):
                    LOGS_IN.add(top.name)
        for path, tree, source in self.test_modules():
            lines = source.splitlines()
            functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            entries = dict(ENTRY_POINTS)
            # a module helper that hands one of its parameters to a command becomes one
            for _ in range(3):
                for name, f in functions.items():
                    if name.startswith("test_") or name in entries:
                        continue
                    params = [a.arg for a in f.args.args]
                    for call, command, arg in self._entry_calls(f, entries):
                        callee = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
                        if callee not in LOGS_IN and isinstance(arg, ast.Name) and arg.id in params:
                            entries[name] = (command, params.index(arg.id), arg.id)
            for name, f in functions.items():
                if not name.startswith("test_"):
                    continue
                hits = set()
                for call, command, arg in self._entry_calls(f, entries):
                    callee = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
                    if callee in LOGS_IN:
                        as_owner = any(kw.arg == "as_owner" for kw in call.keywords)
                        if as_owner and self.roles.get(command) and not marked(lines, call.lineno, OWNER_MARK):
                            hits.add(command)
                    elif self.roles.get(command) and _superuser(arg, f) and not marked(lines, call.lineno, OWNER_MARK):
                        hits.add(command)
                for node in ast.walk(f):  # argv: [..., "--database-url", url, ...]
                    if isinstance(node, ast.List | ast.Tuple):
                        items = node.elts
                        for i, item in enumerate(items[:-1]):
                            if _const(item) == "--database-url" and _superuser(items[i + 1], f):
                                if not marked(lines, item.lineno, OWNER_MARK):
                                    command = _command_in(items, self.roles) or _command_near(f, self.roles)
                                    if command:
                                        hits.add(command)
                    # db = ["--database-url", url]; cli.main(["redrive", ..., *db])
                    if isinstance(node, ast.Call) and any(isinstance(a, ast.List) for a in node.args):
                        for a in node.args:
                            if isinstance(a, ast.List) and any(
                                isinstance(e, ast.Starred) and isinstance(e.value, ast.Name) for e in a.elts
                            ):
                                for e in a.elts:
                                    if isinstance(e, ast.Starred) and isinstance(e.value, ast.Name):
                                        bound = _bound_list(f, e.value.id)
                                        if bound is not None and any(
                                            _const(x) == "--database-url" and _superuser(y, f)
                                            for x, y in zip(bound, bound[1:])
                                        ):
                                            command = _command_in(a.elts, self.roles)
                                            if command and not marked(lines, node.lineno, OWNER_MARK):
                                                hits.add(command)
                for node in ast.walk(f):  # a subprocess's OUTBOX_DATABASE_URL
                    if isinstance(node, ast.Dict):
                        for k, v in zip(node.keys, node.values):
                            if (
                                _const(k) == "OUTBOX_DATABASE_URL"
                                and _superuser(v, f)
                                and not marked(lines, v.lineno, OWNER_MARK)
                            ):
                                command = _command_near(f, self.roles)
                                if command:
                                    hits.add(command)
                for command in sorted(hits):
                    self.findings.append(Finding("superuser", f"{rel(path)}::{name}", command))

    def _entry_calls(self, f: ast.AST, entries):
        for node in ast.walk(f):
            if isinstance(node, ast.Call):
                callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if callee in entries:
                    command, index, keyword = entries[callee]
                    arg = next((kw.value for kw in node.keywords if kw.arg == keyword), None)
                    if arg is None and len(node.args) > index:
                        arg = node.args[index]
                    if arg is not None:
                        yield node, command, arg

    # -- row 4 ---------------------------------------------------------------------

    def pgtap(self) -> None:
        for path in sorted((ROOT / "pgtap").glob("*.sql")):
            text = path.read_text()
            if SQL_OWNER_MARK in text:
                continue
            calls = set(re.findall(r"\b(?:outbox|inbox)\.([a-z_]+)\s*\(", text)) & self.granted
            if calls and not re.search(r"\bSET\s+(?:LOCAL\s+)?(?:ROLE|SESSION\s+AUTHORIZATION)\b", text, re.I):
                self.findings.append(Finding("pgtap", rel(path), ",".join(sorted(calls))[:80]))

    # -- rows 5 and 6 --------------------------------------------------------------

    def races(self) -> None:
        for path, tree, source in self.test_modules(unit=True):
            lines = source.splitlines()
            for f in ast.walk(tree):
                if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or not f.name.startswith("test_"):
                    continue
                for block in _blocks(f):
                    for i, stmt in enumerate(block):
                        if _is_sleep(stmt) and any(isinstance(s, ast.Assert) for s in block[i + 1 :]):
                            if not marked(lines, stmt.lineno, RACE_MARK):
                                self.findings.append(Finding("race", f"{rel(path)}::{f.name}", "sleep-then-assert"))
                for node in ast.walk(f):
                    if (
                        isinstance(node, ast.Assert)
                        and _clock_bound(node.test, f)
                        and not marked(lines, node.lineno, RACE_MARK)
                    ):
                        self.findings.append(Finding("race", f"{rel(path)}::{f.name}", "wall-clock bound"))
                if _is_property(f) and not _asserts(f):
                    self.findings.append(
                        Finding("cannot-fail", f"{rel(path)}::{f.name}", "property test without an assert")
                    )

    # -- row 7 ---------------------------------------------------------------------

    def cluster_kinds(self) -> None:
        path = TESTS / "chaos" / "test_cluster_faults.py"
        text = path.read_text() if path.exists() else ""
        for kind in CLUSTER_KINDS:
            if f'"{kind}"' not in text:
                self.findings.append(Finding("cluster-kind", "tests/chaos/test_cluster_faults.py", kind))

    def test_modules(self, unit: bool = False):
        for path in sorted(TESTS.rglob("test_*.py")):
            if not unit and path.is_relative_to(TESTS / "unit"):
                continue
            source = path.read_text()
            yield path, ast.parse(source), source

    def run(self) -> list[Finding]:
        self.defaults()
        self.superuser()
        self.pgtap()
        self.races()
        self.cluster_kinds()
        return self.findings


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _enclosing(tree: ast.AST, line: int) -> str:
    best = "<module>"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0):
            best = node.name
            if node.name.startswith("test_"):
                return best
    return best


def _superuser(arg: ast.AST, f: ast.AST) -> bool:
    if isinstance(arg, ast.Name):
        if arg.id in SUPERUSER_NAMES:
            # unless the test rebinds it to a login
            for node in ast.walk(f):
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == arg.id for t in node.targets
                ):
                    return False
            return True
        for node in ast.walk(f):  # url = server.dsn(...)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == arg.id for t in node.targets):
                return _superuser(node.value, f) if not isinstance(node.value, ast.Name) else False
        return False
    if isinstance(arg, ast.Call):
        callee = arg.func.attr if isinstance(arg.func, ast.Attribute) else getattr(arg.func, "id", "")
        return callee == "dsn"
    return False


def _command_in(items, roles: dict[str, str | None]) -> str | None:
    """The first constant of an argv that names a command with a role."""
    for item in items:
        v = _const(item)
        if v in roles:
            return v if roles[v] else None
    return None


def _bound_list(f: ast.AST, name: str) -> list[ast.expr] | None:
    for node in ast.walk(f):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if isinstance(node.value, ast.List | ast.Tuple):
                return list(node.value.elts)
    return None


def _command_near(f: ast.AST, roles: dict[str, str | None]) -> str | None:
    """The pgoutbox command a test's subprocess runs: a constant naming one (a
    subscript's key, such as row["status"], names a column, not a command)."""
    keys = {id(n.slice) for n in ast.walk(f) if isinstance(n, ast.Subscript)}
    for node in ast.walk(f):
        if id(node) in keys:
            continue
        v = _const(node)
        if v in roles and roles[v]:
            return v
    return None


def _blocks(f: ast.AST):
    for node in ast.walk(f):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                if isinstance(node, (ast.While, ast.For, ast.AsyncFor)) and name == "body":
                    continue  # a poll loop's sleep
                yield block


def _is_sleep(stmt: ast.stmt) -> bool:
    if not isinstance(stmt, ast.Expr):
        return False
    call = stmt.value.value if isinstance(stmt.value, ast.Await) else stmt.value
    return isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", "")) == "sleep"


_CLOCKS = {"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns"}


def _clock_bound(test: ast.AST, f: ast.AST) -> bool:
    """An assert comparing a clock reading, or a name computed from one."""
    if not any(
        isinstance(n, ast.Compare) and any(isinstance(o, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for o in n.ops)
        for n in ast.walk(test)
    ):
        return False
    timed = set()
    for node in ast.walk(f):
        if isinstance(node, ast.Assign) and any(
            isinstance(c, ast.Call) and getattr(c.func, "attr", None) in _CLOCKS for c in ast.walk(node.value)
        ):
            timed |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(test):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in _CLOCKS:
            return True
        if isinstance(node, ast.Name) and (node.id in timed or node.id in {"elapsed", "took", "duration"}):
            return True
    return False


def _asserts(f: ast.AST) -> bool:
    """An assert, a raise, or a call to a raise_*/assert_*/check_* helper."""
    for n in ast.walk(f):
        if isinstance(n, (ast.Assert, ast.Raise)):
            return True
        if isinstance(n, ast.Call):
            name = getattr(n.func, "id", getattr(n.func, "attr", ""))
            if name.startswith(("raise_", "assert_", "check_")):
                return True
    return False


def _is_property(f: ast.AST) -> bool:
    for d in getattr(f, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        if getattr(target, "id", getattr(target, "attr", None)) == "given":
            return True
    return False


def counts(findings: list[Finding]) -> Counter:
    c: Counter = Counter()
    for kind in ("helper", "superuser"):
        c[kind] = len({f.where for f in findings if f.kind == kind})
    for kind in ("setting", "pgtap", "race", "cannot-fail", "cluster-kind"):
        c[kind] = sum(1 for f in findings if f.kind == kind)
    return c


def table(findings: list[Finding]) -> str:
    now = counts(findings)
    out = ["| finding | before | now |", "|---|---|---|"]
    out += [f"| {label} | {BEFORE[kind]} | {now[kind]} |" for kind, label in ROWS]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="every finding, one a line")
    p.add_argument("--check", action="store_true", help="exit 1 on a finding the baseline does not list")
    p.add_argument("--write-baseline", action="store_true", help="rewrite tests/audit_baseline.txt")
    p.add_argument("--root", type=Path, help="audit another checkout (e.g. `git archive` of main) with these rules")
    args = p.parse_args(argv)
    if args.root:
        global ROOT, TESTS
        ROOT, TESTS = args.root.resolve(), args.root.resolve() / "tests"
    findings = Audit().run()
    if args.write_baseline:
        BASELINE.write_text(
            "# scripts/test_audit.py: the findings still to fix (a new one fails the suite)\n"
            + "".join(sorted({f.key() + "\n" for f in findings}))
        )
    print(table(findings))
    if args.list:
        for f in sorted(findings, key=Finding.key):
            print(f.key())
    if args.check:
        known = {
            line.strip() for line in BASELINE.read_text().splitlines() if line.strip() and not line.startswith("#")
        }
        new = sorted({f.key() for f in findings} - known)
        fixed = sorted(known - {f.key() for f in findings})
        if fixed:
            print(f"{len(fixed)} baseline entries are fixed (python scripts/test_audit.py --write-baseline drops them)")
        if new:
            print("new findings (give the reason marker, or fix them):\n" + "\n".join(new))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
