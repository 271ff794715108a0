"""The reference tables (docs/reference.md, and the README's exit codes) are
generated from, or checked against, the code: the error-code table lists
exactly the SqlState enum, the settings table is what `pgoutbox settings
--markdown` prints, the role table names exactly the roles the schema creates.
The README's examples run as written and print what it shows."""

import re
from pathlib import Path

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
