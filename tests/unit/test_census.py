"""support.census on a /proc of files written here: each process started after
the run's main process is charged its CPU by kind, across readings; older
ones are not; what nobody was seen using is the machine's busy time left over."""

from __future__ import annotations

import os
from pathlib import Path

from support.census import TICK, Census, kind


def _process(proc: Path, pid: int, ticks: int, started: int, cmdline: str) -> None:
    d = proc / str(pid)
    d.mkdir(exist_ok=True)
    # pid (comm) state ppid ... utime(14) stime(15) ... starttime(22): split after ")"
    fields = ["S"] + ["0"] * 10 + [str(ticks), "0"] + ["0"] * 6 + [str(started)]
    (d / "stat").write_text(f"{pid} (x y) " + " ".join(fields) + "\n")
    (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())


def _machine(proc: Path, busy: int) -> None:
    (proc / "stat").write_text(f"cpu  {busy} 0 0 1000 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_each_process_started_after_the_run_is_charged_by_kind(tmp_path):
    _machine(tmp_path, 0)
    _process(tmp_path, os.getpid(), 5, 100, "python -m pytest -n 9")
    _process(tmp_path, 7, 10 * TICK, 50, "/usr/sbin/nats-server -p 4222")  # the machine's own, older
    _process(tmp_path, 8, 2 * TICK, 200, "/usr/lib/jvm/bin/java -cp spark")
    census = Census(proc=tmp_path)
    census.read()
    _process(tmp_path, 8, 5 * TICK, 200, "/usr/lib/jvm/bin/java -cp spark")
    _process(tmp_path, 9, 1 * TICK, 300, "/usr/lib/postgresql/15/bin/postgres -D x")
    _machine(tmp_path, 10 * TICK)
    census.read()
    assert dict(census.seconds) == {"java": 5.0, "postgres": 1.0}
    assert census.busy == 10.0
    assert census.lines()[-2:] == [
        f"{'not seen':20}       4 s (processes shorter than a reading, others)",
        f"{'the machine, busy':20}      10 s",
    ]


def test_a_pid_used_again_is_a_new_process(tmp_path):
    _machine(tmp_path, 0)
    _process(tmp_path, os.getpid(), 5, 100, "python -m pytest")
    _process(tmp_path, 8, 3 * TICK, 200, "postgres: a backend")
    census = Census(proc=tmp_path)
    census.read()
    _process(tmp_path, 8, 2 * TICK, 400, "/x/.venv/bin/python3 -m pgoutbox.cli.main relay")  # started later
    census.read()
    assert dict(census.seconds) == {"postgres": 3.0, "pgoutbox commands": 2.0}


def test_the_kind_is_the_first_match_of_the_command_line():
    assert kind("python -c import sys;exec(eval(sys.stdin.readline()))") == "pytest workers"
    assert kind("/x/.venv/bin/python3 -m pgoutbox.cli.main relay") == "pgoutbox commands"
    assert kind("/usr/lib/jvm/bin/java -cp pyspark/jars/* org.apache.spark.deploy.SparkSubmit") == "java"
    assert kind("/bin/sh -c something") == "other"
