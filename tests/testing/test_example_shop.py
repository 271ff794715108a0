"""The example application of examples/shop (docs/testing.md) uses the
testing kit as a team would: its schema and `pgoutbox testing install-tap`
run as the owner, then its pgTAP files under pg_prove and its pytest suite
(with -p pgoutbox.testing) as a login holding only pgoutbox_writer. The
passing cases pass; in their failing twins every case fails, and each
failure names what was expected and what was emitted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest

from pgoutbox.cli import main as cli
from support.roles import login

SHOP = Path(__file__).resolve().parents[2] / "examples" / "shop"


@pytest.fixture
def shop_login(database_url):
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute((SHOP / "schema.sql").read_text())
    assert cli.main(["testing", "install-tap", "--database-url", database_url]) == 0
    return login(database_url, "pgoutbox_writer")


def pg_prove(url: str, path: Path) -> subprocess.CompletedProcess[str]:
    u = urlparse(url)
    command = ["pg_prove", "-h", u.hostname, "-p", str(u.port), "-U", u.username, "-d", u.path.lstrip("/"), str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def shop_pytest(url: str, folder: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "OUTBOX_", "PG"))}
    env["SHOP_DATABASE_URL"] = url
    command = [sys.executable, "-m", "pytest", "-c", str(SHOP / "pytest.ini"), "-p", "no:cacheprovider"]
    return subprocess.run([*command, "-q", str(SHOP / folder)], capture_output=True, text=True, env=env, timeout=120)


def test_the_shops_pgtap_file_passes(shop_login):
    result = pg_prove(shop_login, SHOP / "pgtap" / "test_orders.sql")
    assert result.returncode == 0 and "Result: PASS" in result.stdout, result.stdout + result.stderr


def test_each_assertion_of_the_failing_pgtap_file_fails_naming_expected_and_emitted(shop_login):
    result = pg_prove(shop_login, SHOP / "pgtap" / "failing" / "test_orders_wrong.sql")
    out = result.stderr + result.stdout
    assert result.returncode != 0 and "Failed 4/4 subtests" in out, out
    expected = [
        'an event order_created whose payload contains {"total": 31, "customer": "ada"}',
        "exactly 2 event(s) order_created",
        "no event",
        "order_paid, order_created, in this order",
    ]
    for number, wanted in enumerate(expected, 1):
        block = out.split(f"# Failed test {number}:", 1)[1].split("# Failed test", 1)[0]
        assert f"# expected: {wanted}\n# emitted:  " in block, block
        assert re.search(r"#     order_created \{.*\"total\": \d+.*\} \(ordering_key [0-9a-f-]{36}\)", block), block


def test_the_shops_pytest_suite_passes_with_the_plugin(shop_login):
    result = shop_pytest(shop_login, "tests")
    assert result.returncode == 0 and "6 passed" in result.stdout, result.stdout + result.stderr


def test_each_case_of_the_failing_pytest_suite_fails_naming_expected_and_emitted(shop_login):
    result = shop_pytest(shop_login, "tests_failing")
    out = result.stdout
    assert result.returncode == 1 and "5 failed" in out, out + result.stderr
    for wanted in (
        'expected: an event order_created whose payload contains {"customer": "ada", "total": 31}\nE           emitted:  1 event(s)',
        "expected: exactly 2 event(s) order_created\nE           emitted:  1 event(s)",
        "expected: no event\nE           emitted:  1 event(s)",
        "expected: order_paid, order_created, in this order\nE           emitted:  2 event(s)",
        "assert (422, 'dead_letter') == (200, 'processed')",
    ):
        assert wanted in out, out
