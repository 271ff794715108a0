"""Runs a pgoutbox command under yappi with the CPU clock, and writes its
profile (pstats format) when the command exits (SIGTERM included: the
commands exit normally on it). For the benchmarks' --profile option.

    python bench/profiled.py OUT.pstat consume|relay [args...]

Why yappi and the CPU clock: on this 2-core machine a wall-clock sampler
(py-spy) charges a function for the time its process waits to run again, e.g.
after a socket write woke the receiving process; yappi counts only the CPU a
function used, coroutines included (time spent suspended is not theirs).
Its overhead slows the process (roughly 1.5-2x): read the shares, not the
absolute times. SIGUSR1 starts the count afresh. `python bench/profiled.py --report OUT.pstat [N]` prints the
N functions with most own CPU time, and with most cumulative time.
"""

from __future__ import annotations

import atexit
import pstats
import signal
import sys


def report(path: str, top: int = 40) -> None:
    stats = pstats.Stats(path)
    total = sum(row[2] for row in stats.stats.values())  # type: ignore[attr-defined]
    print(f"{path}: {total:.2f} s of CPU in Python functions (yappi, builtins included)")
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        print(f"--- by {title}")
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3], reverse=True)  # type: ignore[attr-defined]
        for (file, line, name), (_, calls, own, cum, _callers) in rows[:top]:
            where = file.split("site-packages/")[-1].split("/relay/")[-1].split("/spark/")[-1]
            print(
                f"  {100 * own / total:5.1f}% own {100 * cum / total:5.1f}% cum {calls:9d} calls"
                f"  {name} ({where}:{line})"
            )


def main() -> int:
    if sys.argv[1] == "--report":
        report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 40)
        return 0
    out = sys.argv[1]
    import yappi

    yappi.set_clock_type("cpu")
    yappi.start(builtins=True)
    # SIGUSR1 forgets what was counted so far: the bench sends it when its
    # measured stretch begins (start-up and imports left out).
    signal.signal(signal.SIGUSR1, lambda signum, frame: yappi.clear_stats())

    def save() -> None:
        yappi.stop()
        yappi.get_func_stats().save(out, type="pstat")

    atexit.register(save)
    from pgoutbox.cli.main import main as pgoutbox

    return pgoutbox(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
