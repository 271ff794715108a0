"""pgoutbox registry: generate the static handler registry from the manifests,
or check that the generated file is up to date (exit 1 when stale)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from pgoutbox.core import settings
from pgoutbox.core.settings import option
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as cs

COMMAND = "registry"
HELP = "Generate the handler registry from the manifests (generate), or fail when it is stale (check)."


@dataclass(frozen=True)
class RegistryConfig:
    manifest_dir: str = option(cs.MANIFEST_DIR)
    registry_file: str = option(cs.REGISTRY_FILE)


CONFIG = RegistryConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("generate", "check"))


def run(cfg: RegistryConfig, args: argparse.Namespace) -> int:
    if args.action == "generate":
        handlers = registry.generate(Path(cfg.manifest_dir), Path(cfg.registry_file))
        print(f"wrote {cfg.registry_file}: {len(handlers)} handler(s): {', '.join(h.name for h in handlers)}")
        return 0
    try:
        registry.check(Path(cfg.manifest_dir), Path(cfg.registry_file))
    except registry.RegistryStale as exc:
        print(f"pgoutbox registry: {exc}", file=sys.stderr)
        return 1
    print(f"{cfg.registry_file} is up to date")
    return 0
