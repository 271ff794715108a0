"""The docs against a real server: the role table names exactly the roles
the schema creates, and the examples of the README (emit, streams file,
manifest) and of docs/reference.md (migrate) run as written and print what
they show (tests/unit/test_docs_tables.py checks the tables and links)."""

import re
import time
from pathlib import Path

import psycopg
import psycopg.sql

from pgoutbox.cli import main as cli
from pgoutbox.core.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def test_role_table_names_exactly_the_roles_the_schema_creates(conn):
    documented = re.findall(r"^\| `(pgoutbox_\w+)` \|", REFERENCE.split("## Roles", 1)[1], re.M)
    created = [
        r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'pgoutbox\\_%' AND NOT rolcanlogin")
    ]
    assert sorted(documented) == sorted(created)
    assert all(f"`{role}`" in README for role in created), "README: Roles names every role"


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
