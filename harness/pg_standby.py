"""A PostgreSQL primary with a streaming standby on loopback, for the failover
tests and the chaos soak: two EmbeddedPostgres nodes, the standby made with
`pg_basebackup -R -X stream` from the primary, and a promotion that retires
the old primary.

    pair = StandbyPair(root, synchronous=True)
    pair.start()                      # node a primary, node b streaming from it
    url = pair.url()                  # both nodes, target_session_attrs=read-write
    pair.promote("immediate")         # crash a, promote b: b is the primary
    pair.rebuild()                    # a again, as a standby of b (same port)

Synchronous replication (synchronous_standby_names = '*', synchronous_commit
as given, `on` by default): a COMMIT returns once the standby has the WAL, so
a promotion loses nothing a writer saw committed. While no standby streams, a
synchronous primary holds every COMMIT; promote() leaves it that way until
rebuild() brings a standby back (strict), unless asked to relax, which runs the
new primary asynchronously until the rebuild. Asynchronous replication: a
COMMIT returns before the standby has the WAL; a promotion after a crash loses
what had not streamed yet.

The nodes keep their ports for their whole life, so a multi-host URL made once
stays valid across any number of promotions. Every process is started and
stopped through pg_ctl on its own data directory; nothing else is touched.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from pgoutbox.dev.embedded import PG_BIN, EmbeddedPostgres, _as_postgres, _chown_postgres, free_port

# fsync off: the standby's copy survives the primary's crash in memory (no OS
# crash here); it spares a shared test machine the disk flushes.
# wal_sender_timeout stays PostgreSQL's (60 s): at 5 s, pg_basebackup's WAL
# stream, silent for longer on a loaded 2-core machine, was cut and the base
# backup failed.
DEFAULT_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "10",
    "wal_keep_size": "256MB",
    "hot_standby": "on",
    "fsync": "off",
    "wal_receiver_status_interval": "1s",
}


def multi_host_url(ports: list[int], dbname: str = "postgres", host: str = "127.0.0.1", **params: str) -> str:
    """A libpq URL naming every node, e.g. postgresql://postgres@h:p1,h:p2/db?target_session_attrs=read-write."""
    hosts = ",".join(f"{host}:{p}" for p in ports)
    query = "&".join(f"{k}={v}" for k, v in {"target_session_attrs": "read-write", **params}.items())
    return f"postgresql://postgres@{hosts}/{dbname}?{query}"


@dataclass
class StandbyPair:
    root: Path
    synchronous: bool = False
    synchronous_commit: str = "on"  # on (remote flush) or remote_apply; only with synchronous
    settings: dict[str, str] = field(default_factory=dict)
    nodes: list[EmbeddedPostgres] = field(default_factory=list)
    primary_index: int = 0
    promotions: int = 0

    def __post_init__(self) -> None:
        if not self.nodes:
            self.nodes = [
                EmbeddedPostgres(
                    self.root / name,
                    port=free_port(),
                    # The socket (and its lock file) outside the data directory:
                    # a base backup would copy the lock file to the other node.
                    settings={**DEFAULT_SETTINGS, "unix_socket_directories": str(self.root / name), **self.settings},
                )
                for name in ("node_a", "node_b")
            ]

    @property
    def primary(self) -> EmbeddedPostgres:
        return self.nodes[self.primary_index]

    @property
    def standby(self) -> EmbeddedPostgres:
        return self.nodes[1 - self.primary_index]

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def url(self, dbname: str = "postgres", **params: str) -> str:
        """Both nodes; libpq connects to whichever accepts writes."""
        return multi_host_url(self.ports, dbname, **params)

    def dsn(self, dbname: str = "postgres") -> str:
        return self.url(dbname)

    def start(self) -> str:
        """Both nodes up; if either cannot start, neither is left running (a
        caller whose set-up failed has nothing to stop)."""
        self.root.mkdir(parents=True, exist_ok=True)
        _chown_postgres(self.root)
        try:
            self.primary.start()
            with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
                if self.synchronous:
                    conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                    conn.execute(f"ALTER SYSTEM SET synchronous_commit = '{self.synchronous_commit}'")
                else:
                    conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
                conn.execute("SELECT pg_reload_conf()")
            self._base_backup(self.standby, self.primary)
        except BaseException:
            self.stop("immediate")
            raise
        return self.url()

    def _base_backup(self, node: EmbeddedPostgres, source: EmbeddedPostgres) -> None:
        """node becomes a streaming standby of source (its old data removed)."""
        node.stop("immediate")
        shutil.rmtree(node.datadir, ignore_errors=True)
        node.root.mkdir(parents=True, exist_ok=True)
        _chown_postgres(node.root)
        made = subprocess.run(
            _as_postgres(
                [
                    str(PG_BIN / "pg_basebackup"),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(source.port),
                    "-U",
                    "postgres",
                    "-D",
                    str(node.datadir),
                    "-R",
                    "-X",
                    "stream",
                    "-c",
                    "fast",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if made.returncode:
            raise RuntimeError(f"pg_basebackup from port {source.port} failed: {made.stderr.strip()}")
        node.start()
        self.wait_streaming()

    def wait_streaming(self, timeout: float = 30.0) -> None:
        """Until the primary sees the standby streaming (and, synchronous, as its sync standby)."""
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
                rows = conn.execute("SELECT state, sync_state FROM pg_stat_replication").fetchall()
            if ("streaming", wanted) in rows:
                return
            time.sleep(0.1)
        raise TimeoutError(f"no {wanted} standby streaming from port {self.primary.port} after {timeout}s")

    def lag_bytes(self) -> int:
        """WAL the primary wrote that the standby has not replayed yet."""
        with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT coalesce(max(pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)), -1) FROM pg_stat_replication"
            ).fetchone()
        return int(row[0]) if row else -1

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Until the standby has replayed all the WAL the primary has written
        (an asynchronous standby answers reads from where its replay is)."""
        deadline = time.monotonic() + timeout
        while self.lag_bytes() != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the standby on port {self.standby.port} still lags after {timeout}s")
            time.sleep(0.05)

    def promote(self, mode: str = "immediate", *, relax: bool = False) -> float:
        """Retire the primary (pg_ctl stop -m `mode`: immediate is a crash,
        fast a clean shutdown that first streams its WAL to the standby),
        then promote the standby with pg_promote(). Returns the seconds until
        the new primary accepted writes. relax (synchronous only): the new
        primary stops waiting for a standby until rebuild()."""
        started = time.monotonic()
        old = self.primary
        old.stop(mode)
        new = self.standby
        with psycopg.connect(new.dsn(), autocommit=True) as conn:
            done = conn.execute("SELECT pg_promote(true, 60)").fetchone()
            if not (done and done[0]):
                raise RuntimeError(f"pg_promote() on port {new.port} did not finish")
            if self.synchronous and relax:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
                conn.execute("SELECT pg_reload_conf()")
        self.primary_index = 1 - self.primary_index
        self.promotions += 1
        return time.monotonic() - started

    def rebuild(self) -> float:
        """The retired node becomes a standby of the new primary again (on its
        own port); a relaxed synchronous primary waits for it again. Returns
        the seconds it took."""
        started = time.monotonic()
        self._base_backup(self.standby, self.primary)
        if self.synchronous:
            with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
                names = conn.execute("SHOW synchronous_standby_names").fetchone()
                if not names or names[0] != "*":
                    conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                    conn.execute("SELECT pg_reload_conf()")
            self.wait_streaming()
        return time.monotonic() - started

    def restart(self) -> None:
        """The primary restarts in place (no promotion)."""
        self.primary.restart()

    def stop(self, mode: str = "fast") -> None:
        # The standby first: a synchronous primary's shutdown need not wait for it.
        for node in (self.standby, self.primary):
            node.stop(mode)
