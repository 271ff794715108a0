"""The pgtap/*.sql files have the house shape and are numbered like the
sql/ files they test (tests/schema/test_pgtap.py runs them with pg_prove)."""

from __future__ import annotations

from pathlib import Path

PGTAP = Path(__file__).resolve().parents[2] / "pgtap"
FILES = sorted(PGTAP.glob("*.sql"))


def test_every_pgtap_file_has_the_house_shape():
    assert FILES, "no pgTAP files"
    for path in FILES:
        text = path.read_text()
        assert text.startswith("-- "), f"{path.name}: header comment listing its scenarios"
        for needle in ("\\set ON_ERROR_STOP true", "BEGIN;", "SELECT plan(", "SELECT * FROM finish();", "ROLLBACK;"):
            assert needle in text, f"{path.name}: missing {needle}"


def test_pgtap_files_are_numbered_like_the_sql_they_test():
    """NN_name.sql, no two files sharing NN, and NN's tens digit that of an
    sql/ file (the one the file tests: pgtap/README.md)."""
    numbers = [path.name.split("_", 1)[0] for path in FILES]
    assert all(n.isdigit() and len(n) == 2 for n in numbers), numbers
    assert len(set(numbers)) == len(numbers), f"two pgTAP files share a number: {numbers}"
    sql_tens = {p.name[0] for p in (PGTAP.parent / "sql").glob("[0-9][0-9]_*.sql")}
    assert {n[0] for n in numbers} <= sql_tens, numbers
    table = (PGTAP / "README.md").read_text()
    for path in FILES:
        assert f"`{path.name}`" in table, f"{path.name} is missing from the table in pgtap/README.md"
