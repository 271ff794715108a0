"""The reference tables (docs/reference.md) are generated from, or checked
against, the code: the error-code table lists exactly the SqlState enum, the
settings table is what `pgoutbox settings --markdown` prints, the metrics table
is what the workers register, the role table names exactly the roles the schema
creates. The examples of the README (emit, streams file, manifest) and of
docs/reference.md (migrate) run as written and print what they show; the links
of the README and docs/ resolve."""

import re
import time
from pathlib import Path

import psycopg
import psycopg.sql

from pgoutbox.cli import main as cli
from pgoutbox.core import health, settings
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


def test_role_table_names_exactly_the_roles_the_schema_creates(conn):
    documented = re.findall(r"^\| `(pgoutbox_\w+)` \|", REFERENCE.split("## Roles", 1)[1], re.M)
    created = [
        r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'pgoutbox\\_%' AND NOT rolcanlogin")
    ]
    assert sorted(documented) == sorted(created)
    assert all(f"`{role}`" in README for role in created), "README: Roles names every role"


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


# -- the examples of the README and docs/reference.md, run as written ---------


def fenced_after(marker: str, lang: str = "", doc: str = README, where: str = "README") -> str:
    """The first ```lang block of doc whose text starts with marker."""
    for found_lang, text in re.findall(r"^```(\w*)\n(.*?)^```$", doc, re.S | re.M):
        if found_lang == lang and text.startswith(marker):
            return text
    raise AssertionError(f"{where} has no ```{lang} block starting with {marker!r}")


def test_the_readme_streams_file_applies_on_the_quickstart_single_nats_server(nats_server, tmp_path, capsys):
    text = fenced_after("# streams.toml", "toml")
    assert re.search(r"^replicas = 1\b", text, re.M) and re.search(r"^# replicas = 3\b", text, re.M)
    path = tmp_path / "streams.toml"
    path.write_text(text)
    assert cli.main(["streams", "--streams-file", str(path), "--nats-url", nats_server.url]) == 0
    shown = fenced_after("$ pgoutbox streams --streams-file streams.toml").splitlines()[1:]
    assert capsys.readouterr().out.splitlines() == shown
    # The commented production value is what a single server refuses, as the README says.
    path.write_text(re.sub(r"^replicas = 1\b", "replicas = 3", text, flags=re.M))
    assert cli.main(["streams", "--streams-file", str(path), "--nats-url", nats_server.url]) == 2
    err = capsys.readouterr().err.strip()
    assert err in " ".join(README.split()), err


def test_the_reference_migrate_example_shows_its_real_output(empty_database_url, capsys):
    block = fenced_after("$ createdb", "sh", REFERENCE, "docs/reference.md").splitlines()
    first = block.index("$ pgoutbox migrate --database-url postgresql://postgres@127.0.0.1:5432/shop")
    second = block.index("$ pgoutbox migrate --database-url postgresql://postgres@127.0.0.1:5432/shop", first + 1)
    assert cli.main(["migrate", "--database-url", empty_database_url]) == 0
    assert capsys.readouterr().out.splitlines() == block[first + 1 : second]
    assert cli.main(["migrate", "--database-url", empty_database_url]) == 0
    assert capsys.readouterr().out.splitlines() == block[second + 1 :]


def test_the_reference_shows_what_migrate_says_when_the_database_does_not_exist(pg_server, capsys):
    shown = fenced_after("pgoutbox migrate: DatabaseUnavailable", "", REFERENCE, "docs/reference.md").strip()
    assert cli.main(["migrate", "--database-url", pg_server.dsn("shop")]) == ExitCode.DATABASE
    assert capsys.readouterr().err.strip() == shown.replace("5432", str(pg_server.port))


def test_the_readme_emit_commits_the_event_a_writer_emits(database_url):
    """The README's emit block, run as written by a login holding only
    pgoutbox_writer: one event on the subject the README names."""
    block = fenced_after("BEGIN;", "sql")
    name = f"readme_writer_{time.monotonic_ns()}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(
            psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE pgoutbox_writer").format(psycopg.sql.Identifier(name))
        )
        with psycopg.connect(database_url.replace("postgres@", f"{name}@", 1), autocommit=True) as writer:
            cur = writer.cursor()
            cur.execute(block)  # BEGIN; SELECT outbox.emit(...); COMMIT;
        rows = admin.execute("SELECT subject, ordering_key, status FROM outbox.events").fetchall()
    subject = re.search(r"\(here\s+`([\w.]+)`\)", README).group(1)
    assert rows == [(subject, "42", "PENDING")]


def test_the_readme_manifest_generates_a_registry(tmp_path, capsys):
    manifest = fenced_after("# handlers/billing.toml", "toml")
    (tmp_path / "handlers").mkdir()
    (tmp_path / "handlers" / "billing.toml").write_text(manifest)
    registry_file = tmp_path / "handlers.registry.json"
    args = ["--manifest-dir", str(tmp_path / "handlers"), "--registry-file", str(registry_file)]
    assert cli.main(["registry", "generate", *args]) == 0
    assert '"sea__from_vibespro"' in registry_file.read_text()
    assert cli.main(["registry", "check", *args]) == 0
