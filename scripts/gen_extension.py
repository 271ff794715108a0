"""Generates the pgoutbox PostgreSQL extension's files from migrations/.

    pgoutbox.control        default_version = the newest migration's number
    pgoutbox--1.sql         from migrations/0001_*.up.sql
    pgoutbox--A--B.sql      from B's .up.sql (B = A + 1), and from A's .down.sql
                            (B = A - 1, for B >= OLDEST_DOWN only)

extension/Makefile runs it when PGXS builds (`make -C extension`, `make
install/extension`); git ignores the files and the sdist carries them (`make
wheel` generates them first).

The extension's version is the schema version, so outbox.schema_version() and
`SELECT extversion FROM pg_extension` agree, and CREATE EXTENSION walks the same
chain of files as `pgoutbox migrate`. Each script is its migration, unchanged
but for what CREATE/ALTER EXTENSION does itself or must not see:

  * BEGIN; and COMMIT; are taken out: an extension script runs inside the
    command's own transaction and may not end it.
  * top-level statements calling outbox.create_partitions() are taken out: a
    day partition made inside the script would be a member of the extension,
    made again (for another day) by the CREATE EXTENSION that starts a restore,
    and clash with the dumped partitions. Partitions come from the relay's
    housekeeping, `pgoutbox migrate` or `pgoutbox partitions`, outside the
    extension, so pg_dump dumps them (and their rows) whole.

and ends with a generated tail that registers every member table and sequence
with pg_extension_config_dump (so pg_dump keeps their rows), except the tables
a migration seeds at top level with INSERT ... VALUES (schema_migrations and
the one-row settings tables): the scripts insert those rows again at restore,
and dumped copies would collide with them. It also refuses a day partition
that became a member. docs/extension.md explains the choices.

It also generates the testing kit's extension, pgoutbox_tap (docs/testing.md),
from pgtap/helpers/*.sql (the files `pgoutbox testing install-tap` runs):

    pgoutbox_tap.control    default_version = TAP_VERSION; no `requires`: the
                            kit's functions are PL/pgSQL and SQL, bound at
                            call time, so it installs beside pgoutbox made by
                            either the extension or `pgoutbox migrate`, and
                            pgTAP is needed only to run the assertions
    pgoutbox_tap--V.sql     CREATE SCHEMA pgoutbox_tap (a member, dropped with
                            the extension), then the helpers
    pgoutbox_tap--A--V.sql  for every older A: the helpers again (each
                            statement replaces its function)

    python3 scripts/gen_extension.py [--out DIR]          write DIR (default extension/)
    python3 scripts/gen_extension.py --list               the names of the files, one a line
    python3 scripts/gen_extension.py --check [--out DIR]  exit 1 if DIR differs (drift)

Standard library only, and generic: whatever migrations exist are used.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "pgoutbox"
# The oldest version a down script leads to: 10, the version release 0.3.0 (the
# first to ship the extension) creates. No extension database was ever below
# it unless someone asked CREATE EXTENSION for an older VERSION, and every
# release's workers run on the newer schemas (expand migrations), so a rollback
# never needs to go lower. docs/extension.md explains the choice.
OLDEST_DOWN = 10
# The testing kit's extension: bump TAP_VERSION when pgtap/helpers/ changes.
TAP = "pgoutbox_tap"
TAP_VERSION = 1
TAP_FILES = ("events.sql", "upcasters.sql")  # pgoutbox.core.tap.FILES
_TAP_SCHEMA = re.compile(r"^CREATE\s+SCHEMA\s+IF\s+NOT\s+EXISTS\s+pgoutbox_tap\s*;", re.I)
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.(up|down)\.sql$")
_DOLLAR = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")
_SEED = re.compile(r"^INSERT\s+INTO\s+([a-z_][a-z_0-9]*\.[a-z_][a-z_0-9]*)\b[^;]*?\bVALUES\b", re.S | re.I)
_TRANSACTION = re.compile(r"^(BEGIN|COMMIT|END|START\s+TRANSACTION)\b", re.I)
_FORBIDDEN = re.compile(r"^(ROLLBACK|SAVEPOINT|RELEASE|PREPARE\s+TRANSACTION|VACUUM|\\)", re.I)


@dataclass(frozen=True)
class Statement:
    text: str  # the statement with the comment lines right above it
    head: str  # the statement alone, comments stripped from its start


def statements(sql: str) -> list[Statement]:
    """Top-level statements, split at semicolons outside quotes, dollar
    quotes and comments. Joining their texts gives back the file."""
    out: list[Statement] = []
    start = i = 0
    n = len(sql)
    while i < n:
        c = sql[i]
        if sql.startswith("--", i):
            i = sql.find("\n", i)
            i = n if i < 0 else i + 1
        elif sql.startswith("/*", i):
            i = sql.index("*/", i + 2) + 2
        elif c in "'\"":
            i += 1
            while True:
                i = sql.index(c, i) + 1
                if not sql.startswith(c, i):  # '' inside a string is a quote
                    break
                i += 1
        elif c == "$" and (m := _DOLLAR.match(sql, i)) and not (i and (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            i = sql.index(m.group(0), m.end()) + len(m.group(0))
        elif c == ";":
            i += 1
            if i < n and sql[i] == "\n":
                i += 1
            out.append(_statement(sql[start:i]))
            start = i
        else:
            i += 1
    if sql[start:].strip():
        out.append(_statement(sql[start:]))
    return out


def _statement(text: str) -> Statement:
    lines = text.splitlines(keepends=True)
    k = 0
    while k < len(lines) and (not lines[k].strip() or lines[k].lstrip().startswith("--")):
        k += 1
    return Statement(text, "".join(lines[k:]).strip())


def _calls_create_partitions(head: str) -> bool:
    return bool(re.match(r"^(SELECT|PERFORM)\b", head, re.I)) and "outbox.create_partitions(" in head


def script(path: Path, seeded: list[str], command: str) -> str:
    """The extension script made from one migration file."""
    body: list[str] = []
    for s in statements(path.read_text()):
        if _FORBIDDEN.match(s.head):
            raise SystemExit(f"{path.name}: cannot be an extension script: {s.head.splitlines()[0]}")
        if _TRANSACTION.match(s.head):
            verb = command.split()[0]
            body.append(_without(s, f"{s.head.rstrip(';')}: {verb} EXTENSION runs the script in its own transaction"))
        elif _calls_create_partitions(s.head):
            body.append(_without(s, "outbox.create_partitions() (day partitions are never members)"))
        else:
            body.append(s.text)
    header = (
        f"-- Generated by scripts/gen_extension.py from migrations/{path.name}: do not edit.\n"
        f"-- Run by {command}, not by psql.\n"
        f'\\echo Use "{command}" to load this file. \\quit\n'
    )
    return header + "".join(body).rstrip("\n") + "\n\n" + _tail(seeded)


def _without(s: Statement, what: str) -> str:
    lead = s.text.split(s.head, 1)[0]
    return f"{lead}-- (left out of the extension: {what})\n"


def _tail(seeded: list[str]) -> str:
    keep = ", ".join(f"'{t}'" for t in seeded) or "NULL"
    return f"""-- ---- generated tail (scripts/gen_extension.py) ----
-- pg_dump keeps the rows of the extension's tables and sequences, except the
-- tables the scripts seed ({", ".join(seeded) or "none"}):
-- restoring runs the scripts again, which insert those rows themselves. A day
-- partition of outbox.events is never a member (it would be made anew by the
-- CREATE EXTENSION of a restore).
DO $pgoutbox_extension$
DECLARE
    ext oid := (SELECT e.oid FROM pg_catalog.pg_extension AS e WHERE e.extname = '{NAME}');
    rel regclass;
BEGIN
    FOR rel IN
        SELECT c.oid::regclass
        FROM pg_catalog.pg_depend AS d
        INNER JOIN pg_catalog.pg_class AS c ON d.objid = c.oid
        INNER JOIN pg_catalog.pg_extension AS e ON d.refobjid = e.oid
        WHERE d.classid = 'pg_catalog.pg_class'::regclass
            AND d.refclassid = 'pg_catalog.pg_extension'::regclass
            AND d.refobjid = ext
            AND d.deptype = 'e'
            AND c.relkind IN ('r', 'S')
            AND c.relpersistence <> 't'
            AND NOT c.oid = ANY(coalesce(e.extconfig, '{{}}'))
            AND c.oid::regclass::text <> ALL(ARRAY[{keep}]::text[])
    LOOP
        IF EXISTS (
            SELECT 1 FROM pg_catalog.pg_class AS p
            WHERE p.oid = rel AND p.relispartition
                AND pg_catalog.pg_get_expr(p.relpartbound, p.oid) <> 'DEFAULT'
        ) THEN
            RAISE EXCEPTION 'extension script made partition % a member of {NAME}', rel
                USING HINT = 'Migrations must leave outbox.create_partitions() to the workers.';
        END IF;
        PERFORM pg_catalog.pg_extension_config_dump(rel, '');
    END LOOP;
END;
$pgoutbox_extension$;
"""


@dataclass(frozen=True)
class Migration:
    version: int
    up: Path
    down: Path


def migrations(directory: Path) -> list[Migration]:
    files: dict[int, dict[str, Path]] = {}
    for path in sorted(directory.glob("*.sql")):
        m = _FILE.match(path.name)
        if not m:
            raise SystemExit(f"badly named migration file: {path.name}")
        files.setdefault(int(m.group(1)), {})[m.group(3)] = path
    found = [Migration(v, f["up"], f["down"]) for v, f in sorted(files.items()) if set(f) == {"up", "down"}]
    if [m.version for m in found] != list(range(1, len(found) + 1)) or len(found) != len(files):
        raise SystemExit(f"migrations in {directory} are not numbered 1..n with an up and a down each")
    return found


def seeded_tables(found: list[Migration]) -> list[str]:
    """Tables a migration fills with constant rows at top level (INSERT ... VALUES)."""
    tables: set[str] = set()
    for m in found:
        for s in statements(m.up.read_text()):
            if seed := _SEED.match(s.head):
                tables.add(seed.group(1))
    return sorted(tables)


def generate(root: Path = ROOT) -> dict[str, str]:
    """File name -> text, for every file of the extension this script owns."""
    found = migrations(root / "migrations")
    seeded = seeded_tables(found)
    latest = found[-1].version
    out = {
        f"{NAME}.control": (
            "# Generated by scripts/gen_extension.py from migrations/: do not edit.\n"
            "# The extension's version is the schema version (outbox.schema_version()).\n"
            "comment = 'pgoutbox: transactional outbox and idempotent inbox, relayed to NATS JetStream'\n"
            f"default_version = '{latest}'\n"
            "relocatable = false\n"
            "superuser = true\n"
            "trusted = false\n"
        ),
        f"{NAME}--1.sql": script(found[0].up, seeded, f"CREATE EXTENSION {NAME} VERSION '1'"),
    }
    for m in found[1:]:
        a, b = m.version - 1, m.version
        out[f"{NAME}--{a}--{b}.sql"] = script(m.up, seeded, f"ALTER EXTENSION {NAME} UPDATE TO '{b}'")
        if a >= OLDEST_DOWN:
            out[f"{NAME}--{b}--{a}.sql"] = script(m.down, seeded, f"ALTER EXTENSION {NAME} UPDATE TO '{a}'")
    return out | generate_tap(root)


def tap_script(root: Path, command: str, create_schema: bool) -> str:
    """The kit's helpers as an extension script; the schema is made by the
    first version's script only (CREATE SCHEMA IF NOT EXISTS may not meet a
    schema that is not the extension's own)."""
    body: list[str] = []
    for name in TAP_FILES:
        path = root / "pgtap" / "helpers" / name
        for s in statements(path.read_text()):
            if _FORBIDDEN.match(s.head) or _TRANSACTION.match(s.head):
                raise SystemExit(f"pgtap/helpers/{name}: cannot be an extension script: {s.head.splitlines()[0]}")
            made_once = _TAP_SCHEMA.match(s.head)
            body.append(_without(s, "the schema, made once, by the first script") if made_once else s.text)
    header = (
        "-- Generated by scripts/gen_extension.py from pgtap/helpers/: do not edit.\n"
        f"-- Run by {command}, not by psql.\n"
        f'\\echo Use "{command}" to load this file. \\quit\n'
    )
    schema = f"CREATE SCHEMA {TAP};\n\n" if create_schema else ""
    return header + schema + "".join(body).rstrip("\n") + "\n"


def generate_tap(root: Path = ROOT) -> dict[str, str]:
    out = {
        f"{TAP}.control": (
            "# Generated by scripts/gen_extension.py from pgtap/helpers/: do not edit.\n"
            "comment = 'pgoutbox testing kit: pgTAP assertions on emitted events and upcasters'\n"
            f"default_version = '{TAP_VERSION}'\n"
            "relocatable = false\n"
            "superuser = true\n"
            "trusted = false\n"
        ),
        f"{TAP}--{TAP_VERSION}.sql": tap_script(root, f"CREATE EXTENSION {TAP}", create_schema=True),
    }
    for older in range(1, TAP_VERSION):
        out[f"{TAP}--{older}--{TAP_VERSION}.sql"] = tap_script(
            root, f"ALTER EXTENSION {TAP} UPDATE TO '{TAP_VERSION}'", create_schema=False
        )
    return out


def owned(directory: Path) -> set[str]:
    return {
        p.name for name in (NAME, TAP) for p in (*directory.glob(f"{name}--*.sql"), *directory.glob(f"{name}.control"))
    }


def drift(directory: Path, root: Path = ROOT) -> list[str]:
    want = generate(root)
    problems = [f"{directory}/{n} is stale (run make generate/extension)" for n in sorted(owned(directory) - set(want))]
    for name, text in sorted(want.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{directory}/{name} is missing (run make generate/extension)")
        elif path.read_text() != text:
            problems.append(f"{directory}/{name} differs from what migrations/ generate (run make generate/extension)")
    return problems


def write(directory: Path, root: Path = ROOT) -> list[str]:
    """Writes the files that differ, removes the ones no longer made; returns what changed."""
    want = generate(root)
    changed = []
    for stale in sorted(owned(directory) - set(want)):
        (directory / stale).unlink()
        changed.append(f"removed {stale}")
    for name, text in want.items():
        path = directory / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(f"wrote {name}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the folder to write (default: extension/)")
    parser.add_argument("--list", action="store_true", help="print the names of the files, write nothing")
    parser.add_argument("--check", action="store_true", help="exit 1 if the folder differs from migrations/")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    directory = args.out or args.root / "extension"
    if args.list:
        print("\n".join(sorted(n for n in generate(args.root) if n.endswith(".sql"))))
        return 0
    if args.check:
        problems = drift(directory, args.root)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    for line in write(directory, args.root):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
