"""python -m chaos [--profile short|long|cluster-short|cluster] [--seed N] [--seconds S] [--rate R]
[--writers W] [--faults F] [--kinds K,K] [--poison-share P] [--poison-fraction P] [--quiesce-timeout S] [--root DIR]
[--keep]"""

import argparse
import dataclasses
import sys
from pathlib import Path

from .faults import kinds_for
from .harness import PROFILES, run


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="short")
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--seconds", type=float, help="override the profile's load duration")
    ap.add_argument("--rate", type=float, help="override the profile's emits per second")
    ap.add_argument("--writers", type=int, help="override the profile's writer threads")
    ap.add_argument("--faults", type=int, help="override the profile's fault count")
    ap.add_argument("--quiesce-timeout", type=float, help="override how long the run may take to settle after the load")
    ap.add_argument(
        "--poison-share",
        type=float,
        help="share of emits drawn from tests/poison.py (hostile input; 0 switches the poison writer off)",
    )
    ap.add_argument(
        "--poison-fraction", type=float, help="share of committed events the handler answers 422 (default 0.005)"
    )
    ap.add_argument(
        "--kinds", help="comma-separated fault kinds to draw from (default: every kind of the profile's topology)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the data and logs folder")
    ap.add_argument("--root", help="the data and logs folder (new, or empty; default: a new temporary folder)")
    args = ap.parse_args()
    overrides = {
        k: v
        for k, v in (
            ("seconds", args.seconds),
            ("rate", args.rate),
            ("writers", args.writers),
            ("faults", args.faults),
            ("quiesce_timeout", args.quiesce_timeout),
        )
        if v
    }
    if args.poison_share is not None:
        if not 0 <= args.poison_share <= 1:
            ap.error("--poison-share must be between 0 and 1")
        overrides["hostile_share"] = args.poison_share
    if args.poison_fraction is not None:
        if not 0 <= args.poison_fraction <= 1:
            ap.error("--poison-fraction must be between 0 and 1")
        overrides["poison_fraction"] = args.poison_fraction
    if args.kinds:
        overrides["kinds"] = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    profile = dataclasses.replace(PROFILES[args.profile], **overrides)
    try:
        kinds_for(profile.topology, profile.kinds)
    except ValueError as exc:  # an unknown fault kind
        ap.error(str(exc))
    print(f"chaos: profile {args.profile} {profile}, seed {args.seed}", flush=True)
    root = None
    if args.root:
        root = Path(args.root)
        root.mkdir(parents=True, exist_ok=True)
        if any(root.iterdir()):
            ap.error(f"--root {root} is not empty")
    return run(profile, args.seed, root=root, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
