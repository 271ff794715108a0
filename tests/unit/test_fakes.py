"""Every fake of tests/unit/fakes.py offers its real class's methods as the
real class declares them: the same parameters (names, kinds, defaults), sync
or async alike and, for pgoutbox's own classes, the same annotations. A fake
that drifted from the real object would let the unit tier pass code that
calls the real one wrongly."""

from __future__ import annotations

import inspect

import fakes
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from pgoutbox.inbox.handler_client import HandlerClient
from pgoutbox.inbox.store import Inbox
from pgoutbox.outbox.calls import OutboxCalls
from pgoutbox.outbox.publisher import Publisher

# Each fake and the class it stands for.
REAL = {
    fakes.FakeOutboxStore: OutboxCalls,
    fakes.FakePublisher: Publisher,
    fakes.FakeInbox: Inbox,
    fakes.FakeHandlerClient: HandlerClient,
    fakes.FakeNats: Client,
    fakes.FakeJetStream: JetStreamContext,
}
# The fakes' own public methods, for the tests to set up and read their state.
HELPERS = {
    fakes.FakeOutboxStore: {"add", "status"},
    fakes.FakeInbox: {"row"},
}
# Classes of fakes.py that stand for no class: a row's state, held by FakeInbox.
NOT_STAND_INS = {fakes.FakeInboxRow}


def _methods(cls: type) -> dict[str, object]:
    return {n: m for n, m in vars(cls).items() if not n.startswith("_") and inspect.isfunction(m)}


def _shape(sig: inspect.Signature, annotations: bool) -> list[tuple[object, ...]]:
    params = [(p.name, p.kind, p.default, p.annotation if annotations else None) for p in sig.parameters.values()]
    return [*params, ("->", sig.return_annotation if annotations else None)]


def test_every_fake_class_is_checked():
    classes = {c for n, c in vars(fakes).items() if n.startswith("Fake") and inspect.isclass(c)}
    assert classes == set(REAL) | NOT_STAND_INS


@pytest.mark.parametrize("fake", list(REAL), ids=lambda c: c.__name__)
def test_a_fakes_methods_have_their_real_signatures(fake):
    real = REAL[fake]
    own = real.__module__.startswith("pgoutbox.")  # nats-py writes Optional[...]: its names, kinds, defaults only
    for name, method in _methods(fake).items():
        if name in HELPERS.get(fake, set()):
            assert not hasattr(real, name), f"{fake.__name__}.{name} is the real class's now: match it"
            continue
        original = inspect.getattr_static(real, name, None)
        assert inspect.isfunction(original), f"{real.__name__} has no method {name}: a helper, or renamed?"
        assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(original), name
        assert _shape(inspect.signature(method), own) == _shape(inspect.signature(original), own), (
            f"{fake.__name__}.{name}{inspect.signature(method)} != {real.__name__}.{name}{inspect.signature(original)}"
        )
