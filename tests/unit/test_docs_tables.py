"""The reference tables (docs/reference.md) are generated from, or checked
against, the code, with no server: the error-code table lists exactly the
SqlState enum, the settings and metrics tables are what the code declares,
the exit-code table is ExitCode; the links of the README, docs/ and the
CHANGELOG resolve; docs/architecture.md names only code that exists."""

import re
from pathlib import Path

from pgoutbox.cli import main as cli
from pgoutbox.core import health, settings
from pgoutbox.core.errors import ExitCode, SqlState

ROOT = Path(__file__).resolve().parents[2]
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


def test_metrics_table_is_generated_from_the_code():
    assert section("metrics") == health.metrics_table(cli.all_metrics())


def test_the_metrics_table_lists_exactly_what_the_workers_register():
    """families() finds a metric through its attribute: one registered otherwise would be missing."""
    table = set(re.findall(r"^\| `(\w+)` \|", section("metrics"), re.M))
    registered = set()
    for metrics in cli.all_metrics().values():
        for family in metrics.registry.collect():
            registered.add(f"{family.name}_total" if family.type == "counter" else family.name)
    assert table == registered
    assert all(name.startswith("pgoutbox_") for name in table)


def test_every_setting_is_an_outbox_variable_with_a_flag():
    for group in cli.all_settings().values():
        for s in group:
            assert s.env.startswith("OUTBOX_"), s
            assert s.flag.startswith("--"), s


def test_exit_code_table_lists_exactly_the_exit_codes():
    rows = re.findall(r"^\| (\d) \| ", section("exit-codes"), re.M)
    assert [int(r) for r in rows] == [int(c) for c in ExitCode]


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_the_links_of_the_readme_and_the_docs_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists
    and, with #anchor into a Markdown file, one of its headings."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for doc in docs:
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
            path = (doc.parent / target).resolve() if target else doc
            where = f"{doc.relative_to(ROOT)}: ({target}#{anchor})"
            assert path.exists(), where
            if anchor and path.suffix == ".md":
                assert anchor in anchors(path.read_text()), where
            checked += 1
    assert checked > 50


def test_the_changelog_links_name_files_that_exist():
    text = (ROOT / "CHANGELOG.md").read_text()
    targets = re.findall(r"\]\(([^)#:\s]+)(?:#[^)\s]*)?\)", text)
    assert targets
    for target in targets:
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
