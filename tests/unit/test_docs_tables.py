"""The reference tables (docs/reference.md, and the README's exit codes) are
generated from, or checked against, the code: the error-code table lists
exactly the SqlState enum, the settings table is what `pgoutbox settings
--markdown` prints; the README's links resolve and docs/architecture.md names
only code that exists. The checks that need a database are in tests/cli/test_docs.py."""

import re
from pathlib import Path

from pgoutbox.cli import main as cli
from pgoutbox.core import settings
from pgoutbox.core.errors import ExitCode, SqlState

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def section(name: str, text: str = REFERENCE, where: str = "docs/reference.md") -> str:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert m, f"{where} has no {name} section"
    return m.group(1).strip()


def test_error_code_table_lists_exactly_the_codes_python_knows():
    rows = re.findall(r"^\| (OB\d{3}) \| ([A-Z_]+) \|", section("error-codes"), re.M)
    assert sorted(rows) == sorted((s.value, s.name) for s in SqlState)


def test_error_codes_raised_by_the_sql_are_all_documented():
    raised = set()
    for path in (ROOT / "sql").glob("*.sql"):
        raised |= set(re.findall(r"ERRCODE = '(OB\d{3})'", path.read_text()))
    for path in (ROOT / "migrations").glob("*.sql"):
        raised |= set(re.findall(r"ERRCODE = '(OB\d{3})'", path.read_text()))
    assert raised <= {s.value for s in SqlState}, raised - {s.value for s in SqlState}


def test_settings_table_is_generated_from_the_code():
    assert section("settings") == settings.markdown_table(cli.all_settings())


def test_every_setting_is_an_outbox_variable_with_a_flag():
    for group in cli.all_settings().values():
        for s in group:
            assert s.env.startswith("OUTBOX_"), s
            assert s.flag.startswith("--"), s


def test_exit_code_table_lists_exactly_the_exit_codes():
    rows = re.findall(r"^\| (\d) \| ", section("exit-codes"), re.M)
    assert [int(r) for r in rows] == [int(c) for c in ExitCode]
    # Operators find the same table in the README.
    assert section("exit-codes", README, "README") == section("exit-codes")


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), target


def test_the_architecture_names_only_code_that_exists():
    """docs/architecture.md writes `file::name` for every function it walks through."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    cited = re.findall(r"`([\w/.]+\.(?:py|sql))::([\w.]+)`", text)
    assert len(cited) > 20
    for path, name in cited:
        source = (ROOT / path).read_text()
        if path.endswith(".sql"):
            assert re.search(rf"FUNCTION {re.escape(name)}\(", source), f"{path}: no function {name}"
            continue
        *owner, last = name.split(".")
        for part in owner:  # a class, then its method
            assert re.search(rf"^class {part}\b", source, re.M), f"{path}: no class {part}"
        defined = rf"^\s*(?:async def|def|class) {last}\b|@property\n\s*def {last}\b"
        assert re.search(defined, source, re.M), f"{path}: no {name}"
    for path in re.findall(r"`((?:relay|sql|spark|tests)/[\w/.]+\.(?:py|sql))`", text):
        assert (ROOT / path).exists(), path
