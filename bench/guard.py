"""The cost guard (figures, not a test): what an event costs in this checkout
against an earlier commit, side by side in one run, in one table.

It runs the benches themselves, each in interleaved rounds that give both
codes the same moments of this shared machine, and collects the figures they
record (bench/figures.py):

  relay    bench/relay_bench.py --parts af: the relay's drain of a backlog,
           each relay on its defaults and on a database its own release's
           migrations built; events/s, the ratio to raw nats-py
           publish_async of the same messages in the same run, relay and
           PostgreSQL CPU per event;
  emit     bench/emit_bench.py: outbox.emit / a plain INSERT, 4 writers,
           synchronous_commit on, each emit on its own release's schema;
  consume  bench/consumer_bench.py --only g: `pgoutbox consume` / a
           hand-written inbox loop on the same messages and handler (both
           consumers on this checkout's schema), CPU per message;
  e2e      bench/e2e_bench.py: emit -> relay -> JetStream -> consume ->
           handler at 500 events/s on the defaults: p99, and the relay's and
           the consumers' CPU per event.

Then one table, before | this | change, with a flag on every figure more than
--flag (10 %) worse, and the hypervisor's steal over the run. It stays out of
CI: one noisy minute on a shared machine moves a figure by more than 10 %, so
a flag is a reason to look again (rerun, profile), not a verdict. Each bench's
own output goes to a log file named at the end.

    .venv/bin/python bench/guard.py --before COMMIT [--rounds 3] [--events 50000]
        [--parts relay,emit,consume,e2e] [--e2e-rate 500] [--e2e-seconds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import figures
import machine

HERE = Path(__file__).resolve().parent


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    rounds = str(args.rounds)
    return {
        "relay": ["relay_bench.py", "--parts", "af", "--before", args.before, "--events", str(args.events)]
        + ["--rounds", rounds],
        "emit": ["emit_bench.py", "--writers", "4", "--rounds", rounds, "--before", args.before],
        "consume": ["consumer_bench.py", "--only", "g", "--before", args.before, "--rounds", rounds],
        "e2e": ["e2e_bench.py", "--rates", str(args.e2e_rate), "--code", f"{args.before},."]
        + ["--seconds", str(args.e2e_seconds)],
    }


def table(lines: list[dict], flag: float, before: str) -> list[str]:
    """One row per figure: before, this, the change, and FLAG where this is worse by more than `flag`."""
    found: dict[str, dict] = {}
    for line in lines:
        found.setdefault(line["figure"], {"unit": line["unit"], "better": line["better"]})[line["code"]] = line["value"]
    out = [f"{'figure':42s} {before[:12]:>21s} {'this':>21s} {'change':>8s}"]
    for name, row in found.items():
        if "before" not in row or "this" not in row:
            out.append(f"{name:42s} (missing: {'before' if 'before' not in row else 'this'})  FLAG")
            continue
        old, new = row["before"], row["this"]
        change = (new - old) / old if old else 0.0
        worse = -change if row["better"] == "higher" else change
        unit = row["unit"]
        out.append(
            f"{name:42s} {old:>12,.2f} {unit:<8s} {new:>12,.2f} {unit:<8s} {change:>+8.1%}"
            + ("  FLAG" if worse > flag else "")
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, metavar="COMMIT", help="the earlier commit (e.g. the last release)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", type=int, default=50_000, help="the relay drain's backlog")
    ap.add_argument("--parts", default="relay,emit,consume,e2e")
    ap.add_argument("--e2e-rate", type=int, default=500)
    ap.add_argument("--e2e-seconds", type=float, default=15.0)
    ap.add_argument("--flag", type=float, default=0.10, help="flag a figure this much worse (0.10: 10 %%)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - set(commands(args))
    if unknown:
        ap.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(commands(args))}")
    logs = Path(tempfile.mkdtemp(prefix="pgoutbox-guard-"))
    found = logs / "figures.jsonl"
    env = os.environ | {figures.VARIABLE: str(found)}
    print(f"cost guard: this checkout against {args.before}; {machine.load()}", flush=True)
    ticks = machine.cpu_ticks()
    failed = []
    for part in parts:
        command = commands(args)[part]
        started = time.monotonic()
        with (logs / f"{part}.log").open("w") as log:
            code = subprocess.run(
                [sys.executable, str(HERE / command[0]), *command[1:]], env=env, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        print(f"  {part}: {'done' if code == 0 else f'exit {code}'} in {time.monotonic() - started:.0f} s", flush=True)
        if code:
            failed.append(part)
    lines = [json.loads(x) for x in found.read_text().splitlines()] if found.exists() else []
    print()
    print("\n".join(table(lines, args.flag, args.before)))
    print(f"\n{machine.steal_since(ticks)}; {machine.load()}; each bench's output: {logs}/<part>.log")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
