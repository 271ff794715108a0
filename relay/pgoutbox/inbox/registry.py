"""Handler registry: handlers are declared in manifest files, a
generator turns them into one static, deterministically ordered file, and the
consumer loads only that file. A handler change therefore needs a
regeneration (and a restart): there is no hot reload, and `registry check`
fails in CI while the generated file is stale.

Manifest (TOML, any number of `*.toml` files in the manifest directory, each
with one or more [[handler]] tables):

    [[handler]]
    name = "sea__from_vibespro"        # durable consumer and inbox handler name
    url = "http://billing:8080/events"  # where the envelope is POSTed
    subjects = ["vibespro.event.>"]     # or explicit: ["vibespro.event.vibe_created.v1", ...]
    timeout = "10s"                     # optional, like every line below
    stream = "VIBESPRO_EVENTS"          # default: {CONTEXT}_EVENTS
    ack_wait = "30s"
    max_deliver = 5                     # handler failures before the DLQ
    max_ack_pending = 256
    concurrency = 16
    batch_size = 32
    replay_max_attempts = 3             # 0: no automated replay
    tenant_concurrency = 4              # calls in flight per tenant (default: concurrency / 4)
    version = 2                         # the payload version the handler is given
    format = "cloudevents"              # default "pgoutbox" (the envelope)

`subjects`: within one context, each one of
    {context}.event.{event_type}.v{n}   one version of one event type
    {context}.event.{event_type}.*      every version of one event type
    {context}.event.>                   every event of the context
(NATS wildcards, as the durable's filter takes them). They may not overlap:
JetStream refuses a consumer whose filters do, so a `>` stands alone and a
`{event_type}.*` goes with no explicit version of its type.

`version`: the handler gets every payload as this version of its event
type (all its subjects name one event type: explicit versions none newer
than `version`, or `{event_type}.*`): the consumer upcasts older ones
through the upcasters registered in the database (inbox.upcasters), in the
call that records the fetch. A message it cannot bring to `version` (no
chain of upcasters from its version, or a version newer than `version`,
which `{event_type}.*` lets through) is that message's dead letter
(UPCAST_MISSING), replayed like any other once an upcaster is registered or
the handler declares the newer version. Left out, each payload goes as it
came, as before.

`format`: "pgoutbox" (the default) POSTs the envelope; "cloudevents" POSTs
a CloudEvents HTTP request in binary mode (ce-* headers, the payload as the
body; docs/cloudevents.md); "batch" POSTs up to `batch_size` envelopes in one
request and takes one result per message (inbox/batch.py), so its
`batch_size` is at most BATCH_MAX (else BAD_BATCH_SIZE). Any other value is
refused (BAD_FORMAT). The answers mean the same either way.

`tenant_concurrency`: the handler's calls in flight for one tenant (the
Pgoutbox-Tenant-Id header; messages without one share one budget), from 1
to its `concurrency`; the others wait their turn (inbox/tenants.py). Left
out, it stays out of the registry (which reads as it did before it).

Optional values left out stay null in the registry; the consumer fills them
from its OUTBOX_* settings at start-up.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pgoutbox.core import settings
from pgoutbox.core.errors import ConfigError

FORMAT = 1
GENERATED_BY = "pgoutbox registry generate"
# A handler name is a JetStream durable name and a NATS subject token (the
# replay subject carries it), so no dots, unlike the inbox's handler column.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SUBJECT = re.compile(r"^([A-Za-z0-9_-]{1,64})\.event\.([A-Za-z0-9_-]{1,128})\.v([1-9][0-9]{0,8})$")
# The wildcards a handler may take, within one context: every version of one
# event type, or every event of the context.
_ALL_VERSIONS = re.compile(r"^([A-Za-z0-9_-]{1,64})\.event\.([A-Za-z0-9_-]{1,128})\.\*$")
_ALL_EVENTS = re.compile(r"^([A-Za-z0-9_-]{1,64})\.event\.>$")
_STREAM = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# What a handler is sent; the first is the default, left out of the registry.
FORMATS = ("pgoutbox", "cloudevents", "batch")
# The most messages in one request to a handler of format "batch": a request
# carries each envelope whole, so its size grows with the batch, and a handler
# answers within one timeout for all of them.
BATCH_MAX = 1_000


class RegistryError(ConfigError):
    """The handler manifests or the generated registry are invalid."""


class RegistryStale(RegistryError):
    """The generated registry does not match the manifests: regenerate it."""


@dataclass(frozen=True)
class HandlerSpec:
    """One handler as the registry records it (None: the consumer's default)."""

    name: str
    url: str
    context: str
    stream: str
    subjects: tuple[str, ...]
    timeout: float | None = None
    ack_wait: float | None = None
    max_deliver: int | None = None
    max_ack_pending: int | None = None
    concurrency: int | None = None
    batch_size: int | None = None
    replay_max_attempts: int | None = None
    version: int | None = None
    format: str = FORMATS[0]
    tenant_concurrency: int | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["subjects"] = list(self.subjects)
        if self.version is None:
            del data["version"]  # a registry without versions reads as it did before them
        if self.format == FORMATS[0]:
            del data["format"]  # likewise without formats
        if self.tenant_concurrency is None:
            del data["tenant_concurrency"]  # likewise without per-tenant limits
        return data

    @property
    def event_type(self) -> str:
        """The one event type of a handler that declares a version."""
        return _subject_key(self.subjects[0])[1]

    def takes(self, subject: str) -> bool:
        """Whether a message of this subject is one the handler consumes
        (its subjects, wildcards included, as JetStream filters them)."""
        return any(_matches(pattern, subject) for pattern in self.subjects)


_OPTIONAL: dict[str, Any] = {
    "timeout": settings.duration,
    "ack_wait": settings.duration,
    "max_deliver": settings.positive_int,
    "max_ack_pending": settings.positive_int,
    "concurrency": settings.positive_int,
    "batch_size": settings.positive_int,
    "replay_max_attempts": settings.non_negative_int,
    "tenant_concurrency": settings.positive_int,
}
_KNOWN = {"name", "url", "subjects", "stream", "version", "format", *_OPTIONAL}
_MAX_VERSION = 999_999_999  # a subject's version: at most 9 digits


def _subject_key(subject: str) -> tuple[str, str, int]:
    """(context, event type, version) of a handler's subject; a wildcard's
    missing parts are "" and 0 (so it sorts before the subjects it covers)."""
    if m := _SUBJECT.match(subject):
        return m.group(1), m.group(2), int(m.group(3))
    if m := _ALL_VERSIONS.match(subject):
        return m.group(1), m.group(2), 0
    m = _ALL_EVENTS.match(subject)
    assert m is not None
    return m.group(1), "", 0


def _is_subject(subject: Any) -> bool:
    return isinstance(subject, str) and any(p.match(subject) for p in (_SUBJECT, _ALL_VERSIONS, _ALL_EVENTS))


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a last `>` one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(got) == len(want)


def _overlaps(subjects: list[str]) -> list[str]:
    """The subjects another of the list covers (JetStream refuses a consumer
    whose filters overlap)."""
    wildcards = [o for o in subjects if o.endswith((".*", ".>"))]
    return [s for s in subjects if any(o != s and _matches(o, s.replace("*", "v1")) for o in wildcards)]


def _handler(raw: Any, where: str) -> HandlerSpec:
    if not isinstance(raw, dict):
        raise RegistryError(f"{where}: a [[handler]] table is expected")
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise RegistryError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KNOWN))}")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegistryError(f"{where}: name must match {_NAME.pattern}, got {name!r}")
    where = f"{where} ({name})"
    url = raw.get("url")
    if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url):
        raise RegistryError(f"{where}: url must be an http(s) URL, got {url!r}")
    subjects = raw.get("subjects")
    if not isinstance(subjects, list) or not subjects:
        raise RegistryError(f"{where}: subjects must be a non-empty list")
    for subject in subjects:
        if not _is_subject(subject):
            raise RegistryError(
                f"{where}: subject {subject!r} is not {{context}}.event.{{event_type}}.v{{version}}, "
                "{context}.event.{event_type}.* or {context}.event.>"
            )
    if len(set(subjects)) != len(subjects):
        raise RegistryError(f"{where}: a subject is listed twice")
    covered = _overlaps(subjects)
    if covered:
        raise RegistryError(
            f"{where}: subject(s) {', '.join(covered)} covered by another of its subjects; JetStream refuses"
            " overlapping filters"
        )
    contexts = sorted({_subject_key(s)[0] for s in subjects})
    if len(contexts) != 1:
        raise RegistryError(f"{where}: subjects span contexts {contexts}; declare one handler per context")
    context = contexts[0]
    stream = raw.get("stream", f"{context.upper()}_EVENTS")
    if not isinstance(stream, str) or not _STREAM.match(stream):
        raise RegistryError(f"{where}: stream must match {_STREAM.pattern}, got {stream!r}")
    optional: dict[str, Any] = {}
    if "version" in raw:
        optional["version"] = _version(raw["version"], subjects, where)
    if "format" in raw:
        if raw["format"] not in FORMATS:
            raise RegistryError(
                f"{where}: BAD_FORMAT: format must be one of {', '.join(FORMATS)}, got {raw['format']!r}"
            )
        optional["format"] = raw["format"]
    for key, parse in _OPTIONAL.items():
        if key not in raw:
            continue
        value = raw[key]
        if isinstance(value, bool):
            raise RegistryError(f"{where}: {key} = {value!r} is not valid")
        try:
            optional[key] = parse(str(value))
        except ValueError as exc:
            raise RegistryError(f"{where}: {key} = {value!r}: {exc}") from exc
    tenant_concurrency, concurrency = optional.get("tenant_concurrency"), optional.get("concurrency")
    if tenant_concurrency is not None and concurrency is not None and tenant_concurrency > concurrency:
        raise RegistryError(
            f"{where}: tenant_concurrency = {tenant_concurrency} is above concurrency = {concurrency}:"
            " it would never hold anything back"
        )
    if optional.get("format") == "batch" and optional.get("batch_size", 0) > BATCH_MAX:
        raise RegistryError(
            f"{where}: BAD_BATCH_SIZE: batch_size of a handler of format batch is at most {BATCH_MAX},"
            f" got {optional['batch_size']}"
        )
    return HandlerSpec(
        name=name,
        url=url,
        context=context,
        stream=stream,
        subjects=tuple(sorted(subjects, key=_subject_key)),
        **optional,
    )


def _version(value: Any, subjects: list[str], where: str) -> int:
    """A handler's declared payload version: one event type, no subject newer."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_VERSION:
        raise RegistryError(f"{where}: version must be a whole number from 1 to {_MAX_VERSION}, got {value!r}")
    event_types = sorted({_subject_key(s)[1] for s in subjects})
    if len(event_types) != 1 or not event_types[0]:
        raise RegistryError(f"{where}: version needs subjects of one event type, got {event_types}")
    newer = [s for s in subjects if _subject_key(s)[2] > value]
    if newer:
        raise RegistryError(f"{where}: subject(s) {', '.join(newer)} newer than version {value}; upcasters only go up")
    return value


def read_manifests(directory: Path) -> list[HandlerSpec]:
    """Every handler of every *.toml under directory, sorted by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RegistryError(f"manifest directory {directory} (OUTBOX_MANIFEST_DIR or --manifest-dir) does not exist")
    handlers: dict[str, tuple[HandlerSpec, str]] = {}
    for path in sorted(directory.rglob("*.toml")):
        rel = path.relative_to(directory).as_posix()
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise RegistryError(f"{rel}: not valid TOML: {exc}") from exc
        unknown = sorted(set(document) - {"handler"})
        if unknown:
            raise RegistryError(f"{rel}: unknown top-level key(s) {', '.join(unknown)}; use [[handler]] tables")
        entries = document.get("handler", [])
        if not isinstance(entries, list):
            raise RegistryError(f"{rel}: use [[handler]] (an array of tables)")
        for index, raw in enumerate(entries, start=1):
            spec = _handler(raw, f"{rel} handler #{index}")
            if spec.name in handlers:
                raise RegistryError(f"{rel}: handler {spec.name} is already declared in {handlers[spec.name][1]}")
            handlers[spec.name] = (spec, rel)
    if not handlers:
        raise RegistryError(f"no [[handler]] found in {directory}/**/*.toml")
    return [handlers[name][0] for name in sorted(handlers)]


def _digest(handlers: list[dict[str, Any]]) -> str:
    canonical = json.dumps(handlers, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def render(handlers: list[HandlerSpec]) -> str:
    """The registry file's exact text: same handlers, same bytes."""
    body = [h.to_json() for h in sorted(handlers, key=lambda h: h.name)]
    document = {
        "format": FORMAT,
        "generated_by": GENERATED_BY,
        "note": "Generated from the handler manifests; do not edit. Regenerate and restart the consumer.",
        "digest": _digest(body),
        "handlers": body,
    }
    return json.dumps(document, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


_REGISTRY_SETTING = "OUTBOX_REGISTRY_FILE or --registry-file"


def generate(manifest_dir: Path, registry_file: Path) -> list[HandlerSpec]:
    handlers = read_manifests(manifest_dir)
    registry_file = Path(registry_file)
    try:
        registry_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = registry_file.with_name(registry_file.name + ".tmp")
        tmp.write_text(render(handlers), encoding="utf-8")
        tmp.replace(registry_file)  # readers never see half a file
    except OSError as exc:
        raise RegistryError(f"cannot write {registry_file} ({_REGISTRY_SETTING}): {exc.strerror}") from exc
    return handlers


def _read(registry_file: Path) -> str:
    try:
        return registry_file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise RegistryError(
            f"{registry_file} ({_REGISTRY_SETTING}) not found; run `pgoutbox registry generate`"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise RegistryError(f"cannot read {registry_file} ({_REGISTRY_SETTING}): {exc}") from exc


def check(manifest_dir: Path, registry_file: Path) -> None:
    """Raises RegistryStale (with a diff) unless the file is what generate() writes."""
    expected = render(read_manifests(manifest_dir))
    registry_file = Path(registry_file)
    actual = _read(registry_file) if registry_file.exists() else ""
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                actual.splitlines(keepends=True),
                expected.splitlines(keepends=True),
                fromfile=f"{registry_file} (current)",
                tofile=f"{registry_file} (from manifests)",
            )
        )
        raise RegistryStale(f"{registry_file} is stale; run `pgoutbox registry generate`\n{diff}".rstrip())


def load(registry_file: Path) -> list[HandlerSpec]:
    """The handlers of a generated registry; refuses a hand-edited one."""
    registry_file = Path(registry_file)
    try:
        document = json.loads(_read(registry_file))
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{registry_file}: not JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise RegistryError(f"{registry_file}: not a format {FORMAT} registry; regenerate it")
    body = document.get("handlers")
    if not isinstance(body, list) or document.get("digest") != _digest(body):
        raise RegistryError(f"{registry_file}: its digest does not match its handlers (edited by hand?); regenerate it")
    names = {f.name for f in fields(HandlerSpec)}
    handlers = []
    for raw in body:
        # Keys a registry of an earlier release lacks: absent means the default.
        optional = {"version", "format", "tenant_concurrency"}
        if not isinstance(raw, dict) or not (names - optional <= set(raw) <= names):
            raise RegistryError(f"{registry_file}: unexpected handler entry; regenerate it")
        if raw.get("format", FORMATS[0]) not in FORMATS:
            raise RegistryError(f"{registry_file}: BAD_FORMAT: handler format {raw['format']!r} unknown; regenerate it")
        handlers.append(HandlerSpec(**{**raw, "subjects": tuple(raw["subjects"])}))
    return handlers
