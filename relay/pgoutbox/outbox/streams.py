"""JetStream streams, one per bounded context, from a TOML file, and the
start-up checks that the streams keep what the relay publishes (durability,
duplicate window longer than the lease).

    [defaults]                    # optional; every key below may be set here
    retention = "limits"          # limits | interest | workqueue
    storage = "file"              # file | memory
    replicas = 1
    max_age = "7d"                # 0 = keep forever
    max_bytes = -1                # -1 = unlimited; or "512MiB", "10GiB"
    duplicate_window = "2m"       # must be longer than the relay lease

    [streams.sea]                 # one table per context
    name = "SEA_EVENTS"           # default: upper(context) + "_EVENTS"
    subjects = ["sea.event.>"]    # default: ["{context}.event.>"]

apply() makes the server match the file (create, update or leave alone:
idempotent). check() is what the relay runs before it claims anything: a
stream that captures outbox subjects with a duplicate window not longer than
the lease would let a re-claimed event be stored twice, so that refuses; weak
durability (fewer replicas than configured, fewer replicas current than the
stream's own replica count, no fsync on every write) warns. The replica
count is read from the cluster (the stream leader and the replicas it sees
current), not only from the configuration, and reported in Findings.replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig, StreamInfo

from pgoutbox.core.errors import ConfigError
from pgoutbox.core.settings import duration

DEFAULTS: dict[str, Any] = {
    "retention": "limits",
    "storage": "file",
    "replicas": 1,
    "max_age": "7d",
    "max_bytes": -1,
    "duplicate_window": "2m",
}
_STREAM_KEYS = {"name", "subjects", "description", *DEFAULTS}
_CONTEXT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # as the SQL check context_is_a_subject_token
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,255}$")
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
log = logging.getLogger(__name__)
UNAVAILABLE_WAIT = 30.0  # seconds a start-up check waits for a cluster's JetStream to answer
_SIZE_UNIT = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@dataclass(frozen=True)
class StreamSpec:
    context: str
    name: str
    subjects: tuple[str, ...]
    retention: str
    storage: str
    replicas: int
    max_age: float  # seconds, 0 = unlimited
    max_bytes: int  # -1 = unlimited
    duplicate_window: float  # seconds
    description: str = ""

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            description=self.description or f"pgoutbox events of context {self.context}",
            subjects=list(self.subjects),
            retention=RetentionPolicy(self.retention),
            storage=StorageType(self.storage),
            num_replicas=self.replicas,
            max_age=self.max_age,
            max_bytes=self.max_bytes,
            duplicate_window=self.duplicate_window,
        )


def _size(value: Any, where: str) -> int:
    if isinstance(value, int) and value >= -1:
        return value
    m = _SIZE.match(str(value)) if isinstance(value, str) else None
    if not m:
        raise ConfigError(f"{where}: max_bytes must be -1, a byte count or e.g. '512MiB', got {value!r}")
    return int(m.group(1)) * _SIZE_UNIT[m.group(2)]


def _seconds(value: Any, where: str, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    try:
        return duration(str(value))
    except ValueError as exc:
        raise ConfigError(f"{where}: {key}: {exc}") from exc


def _spec(context: str, table: dict[str, Any], defaults: dict[str, Any], where: str) -> StreamSpec:
    unknown = set(table) - _STREAM_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_STREAM_KEYS)}")
    if not _CONTEXT.match(context):
        raise ConfigError(f"{where}: context {context!r} is not a subject token ([A-Za-z0-9_-]{{1,64}})")
    v = {**defaults, **table}
    name = v.get("name") or f"{context.upper().replace('-', '_')}_EVENTS"
    if not isinstance(name, str) or not _STREAM_NAME.match(name):
        raise ConfigError(f"{where}: stream name {name!r} may only hold letters, digits, _ and -")
    subjects = v.get("subjects") or [f"{context}.event.>"]
    if not isinstance(subjects, list) or not all(isinstance(s, str) and s for s in subjects):
        raise ConfigError(f"{where}: subjects must be a list of subject strings")
    if v["retention"] not in {p.value for p in RetentionPolicy}:
        raise ConfigError(f"{where}: retention must be limits, interest or workqueue, got {v['retention']!r}")
    if v["storage"] not in {s.value for s in StorageType}:
        raise ConfigError(f"{where}: storage must be file or memory, got {v['storage']!r}")
    replicas = v["replicas"]
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= 5:
        raise ConfigError(f"{where}: replicas must be an integer from 1 to 5, got {replicas!r}")
    window = _seconds(v["duplicate_window"], where, "duplicate_window")
    if window <= 0:
        raise ConfigError(f"{where}: duplicate_window must be positive")
    return StreamSpec(
        context=context,
        name=name,
        subjects=tuple(subjects),
        retention=v["retention"],
        storage=v["storage"],
        replicas=replicas,
        max_age=_seconds(v["max_age"], where, "max_age"),
        max_bytes=_size(v["max_bytes"], where),
        duplicate_window=window,
        description=str(v.get("description") or ""),
    )


def load(path: str | Path) -> list[StreamSpec]:
    """Parses and validates a streams file; ConfigError says what is wrong and where."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"streams file {path} (OUTBOX_STREAMS_FILE or --streams-file) cannot be read: {exc.strerror}"
        ) from exc
    return loads(text, str(path))


def loads(text: str, path: str = "<streams>") -> list[StreamSpec]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"streams file {path} is not valid TOML: {exc}") from exc
    unknown = set(doc) - {"defaults", "streams"}
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}; expected [defaults] and [streams.<context>]")
    defaults = {**DEFAULTS, **doc.get("defaults", {})}
    if set(defaults) - set(DEFAULTS):
        raise ConfigError(f"{path}: [defaults] may only set {sorted(DEFAULTS)}")
    streams = doc.get("streams")
    if not isinstance(streams, dict) or not streams:
        raise ConfigError(f"{path}: no [streams.<context>] table")
    specs = [_spec(ctx, table, defaults, f"{path} [streams.{ctx}]") for ctx, table in streams.items()]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: two contexts share a stream name: {sorted(names)}")
    return specs


def check_lease(specs: list[StreamSpec], lease: float) -> None:
    for s in specs:
        if s.duplicate_window <= lease:
            raise ConfigError(_window_too_short(s.name, s.duplicate_window, lease))


def _window_too_short(stream: str, window: float, lease: float) -> str:
    return (
        f"stream {stream}: duplicate_window {window:g}s is not longer than the relay lease {lease:g}s; "
        "an event re-claimed after its lease expired could be stored twice. "
        "Lengthen duplicate_window or shorten OUTBOX_RELAY_LEASE."
    )


_COMPARED = (
    "subjects",
    "retention",
    "storage",
    "num_replicas",
    "max_age",
    "max_bytes",
    "duplicate_window",
    "description",
)


def _differences(want: StreamConfig, have: StreamConfig) -> list[str]:
    diffs = []
    for f in _COMPARED:
        a, b = getattr(want, f), getattr(have, f)
        if f == "subjects":
            a, b = sorted(a or []), sorted(b or [])
        if isinstance(a, float) or isinstance(b, float):
            a, b = round(float(a or 0), 3), round(float(b or 0), 3)
        if a != b:
            diffs.append(f"{f}: {b!r} -> {a!r}")
    return diffs


async def apply(js: JetStreamContext, specs: list[StreamSpec]) -> list[tuple[str, str]]:
    """Creates missing streams and updates changed ones; returns (name, what happened)."""
    report = []
    for spec in specs:
        want = spec.config()
        try:
            have = (await js.stream_info(spec.name)).config
        except nats.js.errors.NotFoundError:
            have = None
        try:
            if have is None:
                await js.add_stream(want)
                report.append((spec.name, "created"))
                continue
            diffs = _differences(want, have)
            if not diffs:
                report.append((spec.name, "unchanged"))
                continue
            # Keep what the file does not manage (consumer limits, metadata...).
            await js.update_stream(dataclasses.replace(have, **{f: getattr(want, f) for f in _COMPARED}))
            report.append((spec.name, "updated (" + "; ".join(diffs) + ")"))
        except nats.js.errors.APIError as exc:
            raise ConfigError(f"stream {spec.name}: JetStream refused it [{exc.err_code}]: {exc.description}") from exc
    return report


def captures_outbox_subjects(filter_subject: str) -> bool:
    """Could this stream subject filter capture '{context}.event.{type}.v{n}'?"""
    shape = ("*", "event", "*", "*")
    tokens = filter_subject.split(".")
    for i, token in enumerate(tokens):
        if token == ">":
            return True
        if i >= len(shape):
            return False
        if token != "*" and shape[i] != "*" and token != shape[i]:
            return False
    return len(tokens) == len(shape)


async def _all_streams(js: JetStreamContext, unavailable_for: float = UNAVAILABLE_WAIT) -> list[StreamInfo]:
    """Every stream's info; waits out a cluster electing its JetStream meta
    leader (503 "temporarily unavailable", or no answer at all, for seconds
    after a node is lost)."""
    deadline = time.monotonic() + unavailable_for
    while True:
        try:
            streams: list[StreamInfo] = []
            offset = 0
            while True:
                page = await js.streams_info(offset)
                if not page:
                    return streams
                streams.extend(page)
                offset += len(page)
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _sync_always(monitor_url: str) -> bool | None:
    """The server's fsync policy from its monitoring endpoint (/varz)."""
    async with httpx.AsyncClient(timeout=5) as client:
        varz = (await client.get(monitor_url.rstrip("/") + "/varz")).json()
    config = (varz.get("jetstream") or {}).get("config") or {}
    return bool(config.get("sync_always", False))


@dataclass
class Findings:
    errors: list[str] = dataclasses.field(default_factory=list)  # refuse to start
    durability: list[str] = dataclasses.field(default_factory=list)  # warn (refuse when strict)
    notices: list[str] = dataclasses.field(default_factory=list)  # warn
    replicas: dict[str, Replicas] = dataclasses.field(default_factory=dict)  # per outbox stream


@dataclass(frozen=True)
class Replicas:
    """A stream's replicas as the cluster reports them (stream info `cluster`)."""

    configured: int  # num_replicas
    current: int  # the leader plus the replicas it sees current and online
    leader: str | None
    behind: tuple[str, ...] = ()  # replicas offline or not current

    def describe(self, stream: str) -> str:
        where = f"leader {self.leader}" if self.leader else "no leader"
        late = f", behind: {', '.join(self.behind)}" if self.behind else ""
        return f"stream {stream}: {self.current} of {self.configured} replica(s) current ({where}{late})"


def replicas(si: StreamInfo) -> Replicas:
    """Counts what the cluster holds now; a server outside a cluster is its own leader."""
    configured = si.config.num_replicas or 1
    cluster = si.cluster
    if cluster is None or (cluster.leader is None and not cluster.replicas):
        return Replicas(configured, 1, getattr(cluster, "leader", None))
    peers = cluster.replicas or []
    current = [p.name for p in peers if p.current and not p.offline]
    behind = tuple(str(p.name) for p in peers if not (p.current and not p.offline))
    return Replicas(configured, (1 if cluster.leader else 0) + len(current), cluster.leader, behind)


async def check(
    js: JetStreamContext, lease: float, specs: list[StreamSpec] | None = None, monitor_url: str | None = None
) -> Findings:
    """What is wrong with the streams the relay publishes to."""
    out = Findings()
    wanted = {s.name: s for s in specs or []}
    found = await _all_streams(js)
    outbox = [si for si in found if any(captures_outbox_subjects(f) for f in si.config.subjects or [])]
    for si in outbox:
        c = si.config
        name = str(c.name)
        if (c.duplicate_window or 0) <= lease:
            out.errors.append(_window_too_short(name, c.duplicate_window or 0, lease))
        spec = wanted.get(name)
        if spec and (c.num_replicas or 1) < spec.replicas:
            out.durability.append(
                f"stream {c.name} has {c.num_replicas} replica(s), the streams file asks for "
                f"{spec.replicas}: run `pgoutbox streams`"
            )
        seen = out.replicas[name] = replicas(si)
        log.info(seen.describe(name), extra={"action": "stream_replicas", "stream": c.name})
        if seen.current < seen.configured:
            out.durability.append(
                seen.describe(name) + ": an acknowledged event is stored on fewer servers than configured"
            )
        if c.storage == StorageType.MEMORY:
            out.durability.append(f"stream {c.name} uses memory storage: a server restart loses its messages")
    missing = sorted(set(wanted) - {si.config.name for si in found})
    if missing:
        out.notices.append(f"streams {missing} from the streams file do not exist: run `pgoutbox streams`")
    if not outbox:
        out.notices.append(
            "no JetStream stream captures outbox subjects ({context}.event.>); "
            "events would be dead-lettered as NO_STREAM: run `pgoutbox streams`"
        )
    if monitor_url:
        try:
            if not await _sync_always(monitor_url):
                out.durability.append(
                    "NATS does not fsync every write (jetstream sync_interval is not 'always'): "
                    "an acked event can be lost on power failure"
                )
        except (httpx.HTTPError, ValueError) as exc:
            out.durability.append(f"could not read the NATS fsync policy from {monitor_url}: {exc}")
    else:
        out.durability.append(
            "NATS fsync policy not verified (set OUTBOX_NATS_MONITOR_URL): by default JetStream "
            "acks before the write reaches disk"
        )
    return out
