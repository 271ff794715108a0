"""Where a run's CPU goes, by kind of process: the servers the tests detach
(PostgreSQL, NATS), the JVMs py4j starts, which nobody waits for, and the
rest, none of which the per-test figures of `ChainReport` can see.

A thread of the run's main process reads `/proc` once a second: each process
started after that one is charged, under its kind, the CPU it used since
the last reading. A process that lives less than a second, or what one used
after the last reading before it ended, is missed (short PostgreSQL
backends, quick commands); the summary shows how much that is against the
machine's own busy time over the same stretch (`/proc/stat`), which other
processes on the machine would also fill."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")

# The first match of a process's command line names its kind.
KINDS = (
    ("java", "java"),
    ("postgres", "postgres"),
    ("nats-server", "nats-server"),
    ("chromium", "chromium"),
    ("pgoutbox.cli.main", "pgoutbox commands"),
    ("pgoutbox_spark", "pgoutbox commands"),
    ("-m chaos", "chaos harness"),
    ("exec(eval(sys.stdin", "pytest workers"),  # how pytest-xdist starts a worker
    ("pytest", "pytest"),
    ("python", "other Python"),
)


def kind(cmdline: str) -> str:
    for needle, name in KINDS:
        if needle in cmdline:
            return name
    return "other"


def _stat(path: Path) -> tuple[int, int] | None:
    """(utime + stime, starttime) in clock ticks, or None for a process gone."""
    try:
        fields = (path / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12]), int(fields[19])


def _cmdline(path: Path) -> str:
    try:
        return (path / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def machine_busy(proc: Path) -> int:
    """Clock ticks the machine's CPUs have been busy (not idle, not iowait)."""
    fields = [int(v) for v in (proc / "stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]


class Census:
    def __init__(self, proc: Path = Path("/proc"), interval: float = 1.0):
        self.proc = proc
        self.interval = interval
        self.seconds: dict[str, float] = defaultdict(float)
        self._seen: dict[tuple[int, int], tuple[str, int]] = {}  # (pid, starttime) -> (kind, ticks)
        own = _stat(proc / str(os.getpid()))
        self._since = own[1] if own else 0  # the run's main process started then
        self._busy = machine_busy(proc)
        self.busy = 0.0  # the machine's busy CPU seconds since the start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> None:
        """One reading: charges each process started after the run's main process."""
        for entry in self.proc.iterdir():
            if not entry.name.isdigit():
                continue
            stat = _stat(entry)
            if stat is None or stat[1] <= self._since:
                continue
            key = (int(entry.name), stat[1])
            name, before = self._seen.get(key) or (kind(_cmdline(entry)), 0)
            self.seconds[name] += (stat[0] - before) / TICK
            self._seen[key] = (name, stat[0])
        self.busy = (machine_busy(self.proc) - self._busy) / TICK

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cpu-census", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.read()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.read()

    def lines(self) -> list[str]:
        seen = sum(self.seconds.values())
        out = [f"{name:20} {seconds:7.0f} s" for name, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])]
        out.append(f"{'not seen':20} {max(0.0, self.busy - seen):7.0f} s (processes shorter than a reading, others)")
        out.append(f"{'the machine, busy':20} {self.busy:7.0f} s")
        return out
