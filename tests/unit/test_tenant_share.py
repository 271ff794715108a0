"""The per-tenant limit of a handler's calls in flight (pgoutbox.inbox.tenants)
without a server: who goes at once, who waits and in which order, what a
held message lends to the fetch, and, through the consumer's flow on the
fakes, that a held message is kept alive by in-progress acks and neither
nak'ed nor failed while another tenant's messages are called.
tests/inbox/test_tenant_fairness.py runs it with real processes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fakes import FakeHandlerClient, FakeInbox, FakeJetStream, FakeNats, answers, delivery

from pgoutbox.core import settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.inbox import registry, tenants
from pgoutbox.inbox import settings as consumer_settings
from pgoutbox.inbox.database_gate import DatabaseGate
from pgoutbox.inbox.flow import MessageFlow
from pgoutbox.inbox.metrics import ConsumerMetrics
from pgoutbox.inbox.tenants import Share
from support.waiting import until

CONFIG = settings.build(
    consumer_settings.ConsumerConfig,
    environ={},
    overrides={"database_url": "postgresql://fake@127.0.0.1:1/fake", "nats_url": "nats://127.0.0.1:1"},
)


def env(tenant: str | None, key: str | None = None) -> dict:
    return {"tenant_id": tenant, "ordering_key": key}


class Lender:
    """consumer.Slots' side of lending: the slots lent out now."""

    def __init__(self) -> None:
        self.lent = 0

    def give(self, count: int) -> None:
        self.lent += count

    def take_back(self, count: int) -> None:
        self.lent -= count


async def _started(share: Share, envelope: dict, stopping: asyncio.Event, order: list) -> asyncio.Task:
    """acquire() in a task of its own that records the envelope when its turn comes."""

    async def go() -> bool:
        ok = await share.acquire(envelope, stopping)
        if ok:
            order.append(envelope)
        return ok

    task = asyncio.create_task(go())
    await asyncio.sleep(0)  # one turn of the loop: it runs until it has its turn or waits for it
    return task


def test_the_default_is_a_quarter_of_the_handlers_concurrency_never_below_one():
    assert [tenants.default(c) for c in (1, 2, 4, 5, 64, 100)] == [1, 1, 1, 2, 16, 25]


@pytest.mark.parametrize("value", [0, 65])
def test_a_limit_outside_one_to_the_concurrency_is_refused(value):
    with pytest.raises(ConfigError, match="tenant_concurrency"):
        tenants.checked(value, 64, "handler billing")


async def test_a_tenant_at_its_limit_waits_while_another_tenant_goes_at_once():
    share, stopping, order = Share(2), asyncio.Event(), []
    lender = share.lender = Lender()
    first = [await _started(share, env("slow"), stopping, order) for _ in range(3)]
    fast = await _started(share, env("fast"), stopping, order)
    assert [t.done() for t in first] == [True, True, False] and fast.done()
    assert share.held == 1 and lender.lent == 1  # the third lent its fetch slot
    share.release(env("slow"))
    assert await first[2] is True
    assert share.held == 0 and lender.lent == 0  # and took it back for its call


async def test_held_messages_go_in_arrival_order_within_a_tenant():
    share, stopping, order = Share(1), asyncio.Event(), []
    waiting = [await _started(share, env("t", f"k{i}"), stopping, order) for i in range(4)]
    for _ in range(3):
        share.release(env("t"))
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert [e["ordering_key"] for e in order] == ["k0", "k1", "k2", "k3"]


async def test_a_message_waits_behind_a_held_earlier_one_of_its_ordering_key_whatever_its_tenant():
    share, stopping, order = Share(1), asyncio.Event(), []
    running = await _started(share, env("slow", "a"), stopping, order)
    held = await _started(share, env("slow", "k"), stopping, order)
    behind = await _started(share, env("fast", "k"), stopping, order)  # its tenant is free, its key is not
    other = await _started(share, env("fast", "z"), stopping, order)  # behind its tenant's held message
    assert running.done() and not held.done() and not behind.done() and not other.done()
    share.release(env("slow"))  # the slow call ends: its held message goes, then the one behind it on "k"
    await asyncio.gather(held, behind)
    assert not other.done()  # its tenant's one call is in flight now
    share.release(env("fast"))
    await other
    assert [(e["tenant_id"], e["ordering_key"]) for e in order] == [
        ("slow", "a"),
        ("slow", "k"),
        ("fast", "k"),
        ("fast", "z"),
    ]


async def test_messages_without_a_tenant_share_one_budget():
    share, stopping, order = Share(1), asyncio.Event(), []
    await _started(share, env(None), stopping, order)
    second = await _started(share, {}, stopping, order)  # no tenant_id at all: the same budget
    assert not second.done()
    share.release(env(None))
    assert await second is True


async def test_a_held_message_gives_up_its_place_when_the_consumer_stops():
    share, stopping, order = Share(1), asyncio.Event(), []
    lender = share.lender = Lender()
    gauge = ConsumerMetrics().tenant_held.labels("billing")
    share._held_gauge = gauge
    await _started(share, env("t"), stopping, order)
    held = await _started(share, env("t"), stopping, order)
    assert gauge._value.get() == 1
    stopping.set()
    assert await held is False
    assert share.held == 0 and lender.lent == 0 and gauge._value.get() == 0
    assert await share.acquire(env("t"), stopping) is False  # at its limit, stopping: no wait


async def test_a_cancelled_waiter_leaves_the_queue_and_the_one_behind_it_on_its_key_goes():
    share, stopping, order = Share(1), asyncio.Event(), []
    lender = share.lender = Lender()
    await _started(share, env("slow"), stopping, order)
    held = await _started(share, env("slow", "k"), stopping, order)
    behind = await _started(share, env("fast", "k"), stopping, order)
    held.cancel()
    assert await behind is True
    with pytest.raises(asyncio.CancelledError):
        await held
    assert share.held == 0 and lender.lent == 0


class SlowForOneTenant(FakeHandlerClient):
    """Answers 200; a call for tenant "slow" waits until `go` is set."""

    def __init__(self) -> None:
        super().__init__(200)
        self.go = asyncio.Event()
        self.running: list[str] = []

    async def call(self, url, body, envelope, **kwargs):
        self.running.append(envelope["message_id"])
        try:
            if envelope["tenant_id"] == "slow":
                await self.go.wait()
            return await super().call(url, body, envelope, **kwargs)
        finally:
            self.running.remove(envelope["message_id"])


async def test_in_the_flow_a_held_message_is_kept_alive_and_neither_nakd_nor_failed_while_another_tenant_is_called():
    spec = registry.HandlerSpec(
        name="billing",
        url="http://127.0.0.1:1/events",
        context="sea",
        stream="SEA_EVENTS",
        subjects=("sea.event.order_created.v1",),
    )
    # not default: in-progress acks every 30 ms, so that a held message needs them within the test
    handler = dataclasses.replace(consumer_settings.resolve(spec, CONFIG), ack_wait=0.09, tenant_concurrency=1)
    client, inbox, nc = SlowForOneTenant(), FakeInbox(), FakeNats()
    metrics = ConsumerMetrics()
    flow = MessageFlow(
        inbox=inbox,  # type: ignore[arg-type]
        client=client,  # type: ignore[arg-type]
        nc=nc,
        js=FakeJetStream(),
        metrics=metrics,
        retry_backoff=consumer_settings.retry_backoff(CONFIG),
        replay_backoff=consumer_settings.replay_backoff(CONFIG),
        stopping=asyncio.Event(),
        gate=DatabaseGate(inbox.schema_version),
        tenants={"billing": Share(1, metrics.tenant_held.labels("billing"), metrics.tenant_holds.labels("billing"))},
    )
    slow1, slow2 = (delivery(nc, seq=i, tenant_id="slow") for i in (1, 2))
    fast = delivery(nc, seq=3, tenant_id="fast")
    outcomes: dict[str, object] = {}
    beat = asyncio.create_task(flow.heartbeat.run())
    fetch = asyncio.create_task(
        flow.handle_fetch([slow1, slow2, fast], handler, lambda m, o: outcomes.__setitem__(m.reply, o))
    )
    try:
        await until(lambda: outcomes.get(fast.reply) == "processed", 5, "the other tenant's message processed")
        held = metrics.registry.get_sample_value("pgoutbox_consumer_tenant_held_messages", {"handler": "billing"})
        assert held == 1 and client.running == [slow1.headers["Nats-Msg-Id"]]
        await until(lambda: b"+WPI" in answers(nc, slow2), 5, "an in-progress ack of the held message")
        client.go.set()
        await fetch
    finally:
        beat.cancel()
        client.go.set()
    assert outcomes == {slow1.reply: "processed", slow2.reply: "processed", fast.reply: "processed"}
    assert [c[0] for c in client.calls] == [m.headers["Nats-Msg-Id"] for m in (fast, slow1, slow2)]
    assert not any(a.startswith(b"-NAK") for m in (slow1, slow2, fast) for a in answers(nc, m))
    assert answers(nc, slow2)[-1] == b""  # acked once its call was made
    assert inbox.row(slow2.headers["Nats-Msg-Id"], "billing").failures == 0
    assert metrics.registry.get_sample_value("pgoutbox_consumer_tenant_holds_total", {"handler": "billing"}) == 1


def _manifest(tmp_path, extra: str):
    (tmp_path / "h.toml").write_text(
        '[[handler]]\nname = "billing"\nurl = "http://127.0.0.1:1/events"\n'
        f'subjects = ["sea.event.order_created.v1"]\n{extra}\n'
    )
    return registry.read_manifests(tmp_path)


def test_a_manifest_key_above_the_handlers_concurrency_is_refused_and_one_left_out_stays_out_of_the_registry(
    tmp_path,
):
    with pytest.raises(registry.RegistryError, match="tenant_concurrency = 9 is above concurrency = 8"):
        _manifest(tmp_path, "concurrency = 8\ntenant_concurrency = 9")
    (spec,) = _manifest(tmp_path, "concurrency = 8")
    assert "tenant_concurrency" not in spec.to_json()  # a registry as earlier releases wrote and read it
    assert consumer_settings.resolve(spec, CONFIG).tenant_concurrency == 2
    (spec,) = _manifest(tmp_path, "tenant_concurrency = 64")
    assert consumer_settings.resolve(spec, CONFIG).tenant_concurrency == 64  # up to the default concurrency


def test_a_setting_above_a_handlers_concurrency_stops_the_start_with_the_handler_named(tmp_path):
    (spec,) = _manifest(tmp_path, "concurrency = 8")
    # not default: the test is about a tenant_concurrency the handler's concurrency cannot take
    cfg = dataclasses.replace(CONFIG, tenant_concurrency=16)
    with pytest.raises(ConfigError, match="handler billing: tenant_concurrency=16"):
        consumer_settings.resolve(spec, cfg)
    with pytest.raises(ConfigError, match="OUTBOX_CONSUMER_TENANT_CONCURRENCY"):
        dataclasses.replace(CONFIG, tenant_concurrency=65)
