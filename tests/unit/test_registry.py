"""Handler registry: manifests -> a static registry with stable
ordering; the consumer loads only that file; the check fails when stale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pgoutbox.cli import main as cli
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as consumer_settings
from support.inbox import consumer_config

ROOT = Path(__file__).resolve().parents[2]

BILLING = """
[[handler]]
name = "billing"
url = "http://billing:8080/events"
subjects = ["vibespro.event.vibe_created.v10", "vibespro.event.vibe_created.v2", "vibespro.event.a_thing.v1"]
timeout = "5s"
max_deliver = 7
"""
AUDIT = """
[[handler]]
subjects = ["sea.event.order_created.v1"]
url = "http://audit:9000/in"
name = "audit"
replay_max_attempts = 0

[[handler]]
name = "zeta"
url = "https://zeta.example/hook"
subjects = ["sea.event.order_created.v1", "sea.event.order_paid.v1"]
stream = "SEA_EVENTS_MIRROR"
"""


def _manifests(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def test_the_generated_registry_is_sorted_and_byte_stable(tmp_path):
    one = _manifests(tmp_path / "one", {"billing.toml": BILLING, "audit.toml": AUDIT})
    # The same handlers, split, named and ordered differently.
    two = _manifests(
        tmp_path / "two",
        {
            "z/first.toml": AUDIT.split('[[handler]]\nname = "zeta"')[0],
            "a.toml": '[[handler]]\nname = "zeta"' + AUDIT.split('[[handler]]\nname = "zeta"')[1] + BILLING,
        },
    )
    registry.generate(one, tmp_path / "one.json")
    registry.generate(two, tmp_path / "two.json")
    registry.generate(one, tmp_path / "again.json")
    text = (tmp_path / "one.json").read_bytes()
    assert text == (tmp_path / "two.json").read_bytes() == (tmp_path / "again.json").read_bytes()

    document = json.loads(text)
    assert [h["name"] for h in document["handlers"]] == ["audit", "billing", "zeta"]
    billing = document["handlers"][1]
    # Subjects by context, event type, then version as a number (v2 before v10).
    assert billing["subjects"] == [
        "vibespro.event.a_thing.v1",
        "vibespro.event.vibe_created.v2",
        "vibespro.event.vibe_created.v10",
    ]
    assert (billing["context"], billing["stream"], billing["timeout"], billing["max_deliver"]) == (
        "vibespro",
        "VIBESPRO_EVENTS",
        5.0,
        7,
    )
    assert billing["ack_wait"] is None  # not in the manifest: the consumer's default applies
    assert document["handlers"][2]["stream"] == "SEA_EVENTS_MIRROR"
    assert document["handlers"][0]["replay_max_attempts"] == 0


def test_the_check_fails_when_the_registry_is_stale_and_passes_once_regenerated(tmp_path):
    manifests = _manifests(tmp_path / "m", {"billing.toml": BILLING})
    target = tmp_path / "handlers.registry.json"
    args = ["--manifest-dir", str(manifests), "--registry-file", str(target)]
    assert cli.main(["registry", "check", *args]) == 1  # not generated yet
    assert cli.main(["registry", "generate", *args]) == 0
    assert cli.main(["registry", "check", *args]) == 0

    (manifests / "billing.toml").write_text(BILLING.replace("max_deliver = 7", "max_deliver = 8"))
    with pytest.raises(registry.RegistryStale) as info:
        registry.check(manifests, target)
    assert "run `pgoutbox registry generate`" in str(info.value)
    assert '-      "max_deliver": 7,' in str(info.value) and '+      "max_deliver": 8,' in str(info.value)
    assert cli.main(["registry", "check", *args]) == 1

    (manifests / "new.toml").write_text(AUDIT)  # a new handler is a change too
    assert cli.main(["registry", "generate", *args]) == 0
    assert cli.main(["registry", "check", *args]) == 0


def test_the_consumer_loads_only_the_generated_file(tmp_path):
    manifests = _manifests(tmp_path / "m", {"billing.toml": BILLING})
    target = tmp_path / "handlers.registry.json"
    registry.generate(manifests, target)
    cfg = consumer_config(None, "nats://unused", target, max_deliver="3", ack_wait="30s")
    shutil.rmtree(manifests)  # the consumer never reads them
    [h] = consumer_settings.load_handlers(cfg)
    assert (h.name, h.max_deliver, h.ack_wait, h.timeout) == ("billing", 7, 30.0, 5.0)  # manifest, then default

    # A hand edit is refused: changes go through the manifests and a regeneration.
    document = json.loads(target.read_text())
    document["handlers"][0]["url"] = "http://elsewhere/"
    target.write_text(json.dumps(document))
    with pytest.raises(registry.RegistryError, match="edited by hand"):
        consumer_settings.load_handlers(cfg)
    target.unlink()
    with pytest.raises(registry.RegistryError, match="run `pgoutbox registry generate`"):
        consumer_settings.load_handlers(cfg)


def test_a_subset_of_handlers_can_be_run(tmp_path):
    target = tmp_path / "r.json"
    registry.generate(_manifests(tmp_path / "m", {"a.toml": AUDIT}), target)
    cfg = consumer_config(None, "nats://unused", target, handlers="zeta")
    assert [h.name for h in consumer_settings.load_handlers(cfg)] == ["zeta"]
    cfg = consumer_config(None, "nats://unused", target, handlers="zeta,nope")
    with pytest.raises(Exception, match="nope"):
        consumer_settings.load_handlers(cfg)


@pytest.mark.parametrize(
    "manifest, message",
    [
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.created"]', "{context}.event.>"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.*.v1"]', "{context}.event.>"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.>"]', "{context}.event.>"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["*.event.>"]', "{context}.event.>"),
        (
            '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.>", "sea.event.a.v1"]',
            "sea.event.a.v1 covered by another",
        ),
        (
            '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.*", "sea.event.a.v2"]',
            "sea.event.a.v2 covered by another",
        ),
        (
            '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.>", "vibespro.event.>"]',
            "one handler per context",
        ),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.>"]\nversion = 2', "one event type"),
        (
            '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1", "vibespro.event.a.v1"]',
            "one handler per context",
        ),
        ('[[handler]]\nname = "x.y"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1"]', "name must match"),
        ('[[handler]]\nname = "x"\nurl = "ftp://h/"\nsubjects = ["sea.event.a.v1"]', "http(s) URL"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = []', "non-empty list"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1"]\ntimeout = "soon"', "timeout"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1"]\nmax_deliver = 0', "max_deliver"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1"]\nretries = 3', "unknown key"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1"]\nversion = 0', "version must"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1"]\nversion = "2"', "version must"),
        ('[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1"]\nversion = true', "version must"),
        (
            '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1", "sea.event.b.v1"]\nversion = 2',
            "one event type",
        ),
        (
            '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v1", "sea.event.a.v3"]\nversion = 2',
            "newer than version 2",
        ),
        ('[handler]\nname = "x"', "use [[handler]]"),
        ('[[handler]\nname = "x"', "not valid TOML"),
        ("", "no [[handler]] found"),
    ],
)
def test_bad_manifests_get_clear_errors(tmp_path, manifest, message):
    manifests = _manifests(tmp_path / "m", {"bad.toml": manifest})
    with pytest.raises(registry.RegistryError) as info:
        registry.read_manifests(manifests)
    assert message in str(info.value)


def test_a_handler_declared_twice_is_refused(tmp_path):
    manifests = _manifests(tmp_path / "m", {"a.toml": BILLING, "b.toml": BILLING})
    with pytest.raises(registry.RegistryError, match="already declared in a.toml"):
        registry.read_manifests(manifests)


def test_the_example_registry_is_up_to_date():
    registry.check(ROOT / "examples" / "handlers", ROOT / "examples" / "handlers.registry.json")


def test_a_declared_version_is_recorded_and_a_registry_without_one_reads_as_before(tmp_path):
    versioned = (
        '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.v2", "sea.event.a.v1"]\nversion = 2'
    )
    target = tmp_path / "r.json"
    registry.generate(_manifests(tmp_path / "m", {"a.toml": versioned, "b.toml": AUDIT}), target)
    specs = {h.name: h for h in registry.load(target)}
    assert specs["x"].version == 2 and specs["x"].event_type == "a"
    assert specs["audit"].version is None
    entries = {h["name"]: h for h in json.loads(target.read_text())["handlers"]}
    assert entries["x"]["version"] == 2 and "version" not in entries["audit"]


# The source documents' consumer (000, "SEA consuming from VIBESPRO_EVENTS"), as they write it.
SOURCE_CONSUMER = """
[[handler]]
name = "sea__from_vibespro"
url = "http://sea:8080/events"
stream = "VIBESPRO_EVENTS"
subjects = ["vibespro.event.>"]
ack_wait = "120s"
max_deliver = 20
max_ack_pending = 50
"""


def test_the_sources_consumer_is_accepted_as_written(tmp_path):
    [spec] = registry.read_manifests(_manifests(tmp_path / "m", {"sea.toml": SOURCE_CONSUMER}))
    assert (spec.name, spec.stream, spec.context, spec.subjects) == (
        "sea__from_vibespro",
        "VIBESPRO_EVENTS",
        "vibespro",
        ("vibespro.event.>",),
    )
    assert (spec.ack_wait, spec.max_deliver, spec.max_ack_pending) == (120.0, 20, 50)


@pytest.mark.parametrize(
    "subjects, subject, taken",
    [
        (["sea.event.>"], "sea.event.order_created.v1", True),
        (["sea.event.>"], "sea.event.order_shipped.v7", True),
        (["sea.event.>"], "land.event.order_created.v1", False),
        (["sea.event.order_created.*"], "sea.event.order_created.v2", True),
        (["sea.event.order_created.*"], "sea.event.order_shipped.v2", False),
        (["sea.event.order_created.v1"], "sea.event.order_created.v2", False),
        (["sea.event.a.v1", "sea.event.b.*"], "sea.event.b.v3", True),
    ],
)
def test_a_handler_takes_the_subjects_its_wildcards_cover_and_no_other(tmp_path, subjects, subject, taken):
    text = f'[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = {json.dumps(subjects)}'
    [spec] = registry.read_manifests(_manifests(tmp_path / "m", {"x.toml": text}))
    assert spec.takes(subject) is taken


def test_a_versioned_handler_may_take_every_version_of_its_event_type(tmp_path):
    text = '[[handler]]\nname = "x"\nurl = "http://h/"\nsubjects = ["sea.event.a.*"]\nversion = 2'
    [spec] = registry.read_manifests(_manifests(tmp_path / "m", {"x.toml": text}))
    assert (spec.version, spec.event_type, spec.takes("sea.event.a.v3")) == (2, "a", True)
