"""The reference tables (docs/reference.md, and the README's exit codes) are
generated from, or checked against, the code: the error-code table lists
exactly the SqlState enum, the settings table is what `pgoutbox settings
--markdown` prints, the metrics table is what the workers register, the role
table names exactly the roles the schema creates.
The README's examples run as written and print what it shows."""

import re
from pathlib import Path

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
    # Operators find the same table in the README.
    assert section("exit-codes", README, "README") == section("exit-codes")


def test_role_table_names_exactly_the_roles_the_schema_creates(conn):
    documented = re.findall(r"^\| `(pgoutbox_\w+)` \|", REFERENCE.split("## Roles", 1)[1], re.M)
    created = [
        r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'pgoutbox\\_%' AND NOT rolcanlogin")
    ]
    assert sorted(documented) == sorted(created)
    assert all(f"`{role}`" in README for role in created), "README: Roles names every role"


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


# -- the README's examples, run as written ------------------------------------


def fenced_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", README, re.S | re.M)


def fenced_after(marker: str, lang: str = "") -> str:
    """The first ```lang block whose text starts with marker."""
    for found_lang, text in fenced_blocks():
        if found_lang == lang and text.startswith(marker):
            return text
    raise AssertionError(f"README has no ```{lang} block starting with {marker!r}")


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


def test_the_readme_migrate_example_shows_its_real_output(empty_database_url, capsys):
    block = fenced_after("$ createdb", "sh").splitlines()
    first = block.index("$ pgoutbox migrate --database-url postgresql://postgres@127.0.0.1:5432/shop")
    second = block.index("$ pgoutbox migrate --database-url postgresql://postgres@127.0.0.1:5432/shop", first + 1)
    assert cli.main(["migrate", "--database-url", empty_database_url]) == 0
    assert capsys.readouterr().out.splitlines() == block[first + 1 : second]
    assert cli.main(["migrate", "--database-url", empty_database_url]) == 0
    assert capsys.readouterr().out.splitlines() == block[second + 1 :]


def test_the_readme_shows_what_migrate_says_when_the_database_does_not_exist(pg_server, capsys):
    shown = fenced_after("pgoutbox migrate: DatabaseUnavailable").strip()
    assert cli.main(["migrate", "--database-url", pg_server.dsn("shop")]) == ExitCode.DATABASE
    assert capsys.readouterr().err.strip() == shown.replace("5432", str(pg_server.port))
