"""The extension files (extension/) are what scripts/gen_extension.py makes
of migrations/, and the generator follows a migration added later; no
server needed (tests/install/test_extension.py installs and runs them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pgoutbox.core import migrate as m

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_extension", ROOT / "scripts" / "gen_extension.py")
assert _spec and _spec.loader
gen_extension = importlib.util.module_from_spec(_spec)
sys.modules["gen_extension"] = gen_extension  # dataclasses look their module up
_spec.loader.exec_module(gen_extension)


LATEST = m.discover()[-1].version


def test_the_extension_files_are_what_the_migrations_generate():
    assert gen_extension.drift() == []
    files = gen_extension.generate()
    assert f"default_version = '{LATEST}'" in files["pgoutbox.control"]
    assert {f"pgoutbox--{v}--{v + 1}.sql" for v in range(1, LATEST)} <= set(files)
    for name, text in files.items():
        if name.endswith(".sql"):
            assert "\nBEGIN;\n" not in text and "\nCOMMIT;\n" not in text, name
            assert "pg_extension_config_dump" in text, name


def test_the_generator_follows_a_migration_added_later(tmp_path):
    """Generic: a new migration gets its update scripts and moves default_version."""
    for folder in ("migrations", "extension"):
        (tmp_path / folder).mkdir()
    for path in (ROOT / "migrations").glob("*.sql"):
        (tmp_path / "migrations" / path.name).write_text(path.read_text())
    nxt = f"{LATEST + 1:04d}_later"
    (tmp_path / "migrations" / f"{nxt}.up.sql").write_text(
        "BEGIN;\nCREATE TABLE IF NOT EXISTS outbox.later (x int);\n"
        "INSERT INTO outbox.schema_migrations (version, name) VALUES (99, 'x');\nCOMMIT;\n"
    )
    (tmp_path / "migrations" / f"{nxt}.down.sql").write_text("BEGIN;\nDROP TABLE outbox.later;\nCOMMIT;\n")
    assert gen_extension.main(["--root", str(tmp_path)]) == 0
    files = {p.name: p.read_text() for p in (tmp_path / "extension").iterdir()}
    assert f"default_version = '{LATEST + 1}'" in files["pgoutbox.control"]
    up = files[f"pgoutbox--{LATEST}--{LATEST + 1}.sql"]
    assert "CREATE TABLE IF NOT EXISTS outbox.later" in up and "\nBEGIN;" not in up
    assert f"pgoutbox--{LATEST + 1}--{LATEST}.sql" in files
    assert gen_extension.main(["--root", str(tmp_path), "--check"]) == 0
    (tmp_path / "migrations" / f"{nxt}.up.sql").write_text("BEGIN;\nSELECT 1;\nCOMMIT;\n")
    assert gen_extension.main(["--root", str(tmp_path), "--check"]) == 1, "drift goes unnoticed"


def test_restore_list_leaves_a_plain_dump_alone():
    toc = "; Archive\n3553; 2606 16674 CONSTRAINT outbox events_p20261124 events_p20261124_pkey postgres\n"
    toc += "3605; 0 0 INDEX ATTACH outbox events_p20261124_pkey postgres\n"
    assert m.restore_list(toc) == (toc, 0)
    extension = "2; 3079 16385 EXTENSION - pgoutbox \n" + toc
    out, skipped = m.restore_list(extension)
    assert skipped == 2 and out.count("\n;3") == 2
