"""mypy over the installed package names. The package `pgoutbox` lives in the
folder relay/ (and pgoutbox_spark in spark/), which mypy cannot map by itself:
this links the folders under their package names in build/typecheck and points
mypy there. Exit status: mypy's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKS = {"pgoutbox": "relay"}


def main() -> int:
    base = ROOT / "build" / "typecheck"
    base.mkdir(parents=True, exist_ok=True)
    for name, folder in LINKS.items():
        link = base / name
        if not link.is_symlink():
            link.symlink_to(ROOT / folder, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(base)}
    mypy = Path(sys.executable).parent / "mypy"
    args = [str(mypy), "--config-file", str(ROOT / "pyproject.toml"), *(f"-p{n}" for n in LINKS)]
    return subprocess.run(args, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
