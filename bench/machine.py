"""What the benchmarks report about the machine they ran on: a shared 2-core
VM whose hypervisor steals CPU time at random, which no figure can hide."""

from __future__ import annotations

import os
from pathlib import Path


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) / {five:.2f} (5 min) on {os.cpu_count()} cores"


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of this machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields)


def steal_since(start: tuple[int, int]) -> str:
    steal, total = cpu_ticks()
    share = (steal - start[0]) / max(1, total - start[1])
    return f"hypervisor steal {share:.1%} of this machine's CPU time"


def cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """User + system CPU time of a process so far (plus its reaped children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")
