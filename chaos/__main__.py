"""python -m chaos [--profile short|long] [--seed N] [--seconds S] [--rate R] [--faults F] [--poison-share P]"""

import argparse
import dataclasses
import sys

from .harness import PROFILES, run


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="short")
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--seconds", type=float, help="override the profile's load duration")
    ap.add_argument("--rate", type=float, help="override the profile's emits per second")
    ap.add_argument("--faults", type=int, help="override the profile's fault count")
    ap.add_argument(
        "--poison-share",
        type=float,
        help="share of emits drawn from tests/poison.py (hostile input; 0 switches the poison writer off)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the data and logs folder")
    args = ap.parse_args()
    overrides = {k: v for k, v in (("seconds", args.seconds), ("rate", args.rate), ("faults", args.faults)) if v}
    if args.poison_share is not None:
        if not 0 <= args.poison_share <= 1:
            ap.error("--poison-share must be between 0 and 1")
        overrides["hostile_share"] = args.poison_share
    profile = dataclasses.replace(PROFILES[args.profile], **overrides)
    print(f"chaos: profile {args.profile} {profile}, seed {args.seed}", flush=True)
    return run(profile, args.seed, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
