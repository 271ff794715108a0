"""scripts/test_audit.py: the suite's own rules, counted. A finding
that tests/audit_baseline.txt does not list fails here: a helper or test that
changes a default without a `# not default: <why>` line, a command under test
run as the superuser, a pgTAP file that never switches role, a race."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("test_audit_script", ROOT / "scripts" / "test_audit.py")
assert _spec and _spec.loader
audit = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = audit  # dataclasses look their module up
_spec.loader.exec_module(audit)


def test_no_new_finding_beyond_the_baseline(capsys):
    assert audit.main(["--check"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.startswith("| finding | before | now |") and out.count("\n|") >= len(audit.ROWS) + 1


def _changes(source: str) -> list[tuple[str, str, int]]:
    return audit.Audit().setting_changes(Path("x.py"), source, ast.parse(source))


def test_a_changed_default_counts_unless_its_reason_is_given():
    plain = 'cfg = consumer_config(url, nats, reg, max_deliver="3", ack_wait="30s", http_port="0")\n'
    assert _changes(plain) == [("max_deliver", "3", 1)]  # 30s is the default, a port an address
    reasoned = "# not default: the test counts three failures\n" + plain
    assert _changes(reasoned) == []
    env = 'env = {"OUTBOX_RELAY_LEASE": "5s", "OUTBOX_RELAY_PUBLISH_TIMEOUT": "5s"}  # not default: a dead relay\n'
    assert _changes(env) == []
    assert _changes(env.split("  #")[0] + "\n") == [("OUTBOX_RELAY_LEASE", "5s", 1)]


def test_sleep_then_assert_and_clock_bounds_are_found(tmp_path, monkeypatch):
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_x.py").write_text(
        "import time\n"
        "def test_a():\n    time.sleep(1)\n    assert done()\n"
        "def test_b():\n    t = time.monotonic()\n    go()\n    assert time.monotonic() - t < 2\n"
        "def test_c():\n    while not done():\n        time.sleep(0.1)\n    assert done()\n"
        "def test_d():\n    time.sleep(1)  # not a race: nothing may happen in this second\n    assert quiet()\n"
    )
    a = audit.Audit()
    monkeypatch.setattr(audit, "TESTS", tmp_path)
    monkeypatch.setattr(audit, "ROOT", tmp_path)
    a.races()
    assert sorted((f.where, f.what) for f in a.findings) == [
        ("unit/test_x.py::test_a", "sleep-then-assert"),
        ("unit/test_x.py::test_b", "wall-clock bound"),
    ]
