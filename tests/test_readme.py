"""The README's reference tables are generated from, or checked against, the
code: the error-code table must list exactly the SqlState enum, and the
configuration table must be what `pgoutbox settings --markdown` prints."""

import re
from pathlib import Path

from pgoutbox import cli, settings
from pgoutbox.errors import SqlState

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def section(name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", README, re.S)
    assert m, f"README has no {name} section"
    return m.group(1).strip()


def test_error_code_table_lists_exactly_the_codes_python_knows():
    rows = re.findall(r"^\| (OB\d{3}) \| ([A-Z_]+) \|", section("error-codes"), re.M)
    assert sorted(rows) == sorted((s.value, s.name) for s in SqlState)


def test_error_codes_raised_by_the_sql_are_all_documented():
    root = Path(__file__).resolve().parent.parent
    raised = set()
    for path in (root / "sql").glob("*.sql"):
        raised |= set(re.findall(r"ERRCODE = '(OB\d{3})'", path.read_text()))
    for path in (root / "migrations").glob("*.sql"):
        raised |= set(re.findall(r"ERRCODE = '(OB\d{3})'", path.read_text()))
    assert raised <= {s.value for s in SqlState}, raised - {s.value for s in SqlState}


def test_settings_table_is_generated_from_the_code():
    assert section("settings") == settings.markdown_table(cli.all_settings())


def test_every_setting_is_an_outbox_variable_with_a_flag():
    for group in cli.all_settings().values():
        for s in group:
            assert s.env.startswith("OUTBOX_"), s
            assert s.flag.startswith("--"), s
