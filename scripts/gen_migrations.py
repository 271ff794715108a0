"""Rewrites the generated definition blocks of the newest migration from sql/.

A migration repeats the definitions it changes. In the newest migration each
function definition sits in a marked block:

    -- generated from sql/30_outbox_api.sql: outbox.claim
    ...the comment above the function, CREATE OR REPLACE FUNCTION, COMMENT ON...
    -- end generated

and this script copies the block's text from the named sql/ file. Only the
newest migration, while unreleased, is generated. A released migration keeps
the definitions it shipped, which later migrations replace, so it carries no
markers: a marker there would claim a sameness with sql/ that no longer holds
(the catalog test proves that the whole chain still builds what sql/ builds).
Starting a new migration releases the previous one: this script takes the
marker lines out of it (comments only: what the file creates is unchanged).

    python scripts/gen_migrations.py           rewrite the blocks; take the
        markers out of the older migrations
    python scripts/gen_migrations.py --check   exit 1 on drift: a block that
        differs from sql/, a function the newest migration defines outside
        a block, or a marker left in an older migration
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BEGIN = re.compile(r"^-- generated from (sql/[0-9a-z_]+\.sql): ([a-z_]+\.[a-z_0-9]+)$")
END = "-- end generated"
CREATE = re.compile(r"^CREATE OR REPLACE FUNCTION ([a-z_]+\.[a-z_0-9]+)\(")
DOLLAR = re.compile(r"\bAS (\$[a-z]*\$)$")


@dataclass(frozen=True)
class Drift:
    migration: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.migration}:{self.line}: {self.message}"


def _is_comment(line: str) -> bool:
    # Section rulers ("-- ---- ...") head a group, not one definition.
    return line.startswith("--") and not line.startswith("-- ----") and line != END and not BEGIN.match(line)


def definitions(lines: list[str], *, unique: bool = True) -> dict[str, tuple[int, int]]:
    """Each function's text as [start, end) line indexes: the comment lines
    right above it, the CREATE statement through the end of its body, and a
    COMMENT ON FUNCTION right after it. A migration may define two overloads
    of one name (each from its own sql/ file): not unique, the second is
    keyed name@line."""
    found: dict[str, tuple[int, int]] = {}
    i = 0
    while i < len(lines):
        m = CREATE.match(lines[i])
        if not m:
            i += 1
            continue
        name = m.group(1)
        start = i
        while start > 0 and _is_comment(lines[start - 1]):
            start -= 1
        j = i
        while not (opening := DOLLAR.search(lines[j])):
            j += 1
        closing = opening.group(1) + ";"
        j += 1
        while lines[j].rstrip() != closing:
            j += 1
        end = j + 1
        if end < len(lines) and lines[end].startswith(f"COMMENT ON FUNCTION {name}("):
            while not lines[end].endswith("';"):
                end += 1
            end += 1
        if name in found and unique:
            raise SystemExit(f"{name} is defined twice in one file")
        found[name if name not in found else f"{name}@{start + 1}"] = (start, end)
        i = end
    return found


def canonical(root: Path, source: str, name: str, cache: dict[str, dict[str, list[str]]]) -> list[str] | None:
    if source not in cache:
        path = root / source
        if not path.is_file():
            cache[source] = {}
        else:
            lines = path.read_text().splitlines()
            cache[source] = {n: lines[a:b] for n, (a, b) in definitions(lines).items()}
    return cache[source].get(name)


def newest_migration(root: Path = ROOT) -> Path:
    ups = sorted((root / "migrations").glob("[0-9][0-9][0-9][0-9]_*.up.sql"))
    if not ups:
        raise SystemExit("no migrations")
    return ups[-1]


def outside_generation(root: Path = ROOT) -> list[Path]:
    """Every migration file but the newest up: the released ones, and the
    newest down (it restores the previous definitions, never sql/'s)."""
    newest = newest_migration(root)
    return [p for p in sorted((root / "migrations").glob("[0-9][0-9][0-9][0-9]_*.sql")) if p != newest]


def without_markers(path: Path) -> str:
    lines = path.read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not (BEGIN.match(line.rstrip("\n")) or line.rstrip("\n") == END))


def generate(path: Path, root: Path = ROOT) -> tuple[str, list[Drift]]:
    """The migration's text with its blocks regenerated, and what is wrong
    that regenerating cannot fix."""
    lines = path.read_text().splitlines()
    out: list[str] = []
    problems: list[Drift] = []
    cache: dict[str, dict[str, list[str]]] = {}
    inside: set[str] = set()
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            if lines[i] == END:
                problems.append(Drift(path.name, i + 1, "an end marker without its start"))
            out.append(lines[i])
            i += 1
            continue
        source, name = m.groups()
        try:
            end = lines.index(END, i + 1)
        except ValueError:
            problems.append(Drift(path.name, i + 1, f"block {name} has no `{END}`"))
            out.extend(lines[i:])
            break
        text = canonical(root, source, name, cache)
        if text is None:
            problems.append(Drift(path.name, i + 1, f"{source} defines no function {name}"))
            text = lines[i + 1 : end]
        inside.add(name)
        out.append(lines[i])
        out.extend(text)
        out.append(END)
        i = end + 1
    for name, (start, _) in definitions(lines, unique=False).items():
        if name.split("@")[0] not in inside:
            problems.append(
                Drift(path.name, start + 1, f"{name} is defined outside a `-- generated from sql/...` block")
            )
    return "\n".join(out) + "\n", problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift, change nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    path = newest_migration(args.root)
    text, problems = generate(path, args.root)
    marked = [p for p in outside_generation(args.root) if without_markers(p) != p.read_text()]
    if args.check:
        problems += [Drift(p.name, 1, "a released migration carries generated-block markers") for p in marked]
    else:
        for older in marked:
            older.write_text(without_markers(older))
            print(f"took the markers out of {older.relative_to(args.root)}")
    for p in problems:
        print(p, file=sys.stderr)
    if args.check:
        if text != path.read_text():
            print(
                f"{path.relative_to(args.root)}: generated blocks differ from sql/; run `make generate/migrations`",
                file=sys.stderr,
            )
            return 1
        return 1 if problems else 0
    if text != path.read_text():
        path.write_text(text)
        print(f"rewrote {path.relative_to(args.root)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
