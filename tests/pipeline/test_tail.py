"""``pipeline.tail`` against a real nats-server, with events published by the real publisher."""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import anyio.abc
import nats
import pytest

from pipeline import tail
from pipeline.embedded import EmbeddedNatsServer
from pipeline.errors import TailError
from pipeline.events import (
    Event,
    FeedbackRecorded,
    PolicyApplied,
    PolicyRejected,
    PolicyUpdated,
    SamplingRecord,
    SessionClosed,
    SessionOpened,
    ToolCallRecord,
    TurnAborted,
    TurnCompleted,
    TurnDelta,
    TurnStarted,
    Usage,
    encode_event,
    new_event_id,
)
from pipeline.publisher import EventPublisher, PublisherConfig
from pipeline.streams import StreamSpec, ensure_stream, event_subject
from pipeline.tail import TailFilter, format_event, tail_events

from ..support.waiting import wait_until

SPEC = StreamSpec()
TENANT = "t0123456789abcdef"
SAMPLING = SamplingRecord(temperature=0.7, top_p=1.0, top_k=-1, max_tokens=64, seed=None)
LINE_START = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} ")


def _base(session: str | None, seq: int = 0, tenant: str = TENANT) -> dict[str, object]:
    return {
        "event_id": new_event_id(),
        "time": time.time(),
        "tenant": tenant,
        "session_id": session,
        "seq": seq,
        "model": "tiny",
        "policy_version": 3,
    }


def _completed(session: str, turn: str, seq: int = 2, **overrides: object) -> TurnCompleted:
    fields: dict[str, object] = {
        **_base(session, seq),
        "turn_id": turn,
        "parent_turn_id": None,
        "request_id": "chatcmpl-1",
        "choice_index": 0,
        "reused_prompt_tokens": 0,
        "prompt_ids": list(range(500)),
        "output_ids": list(range(7)),
        "logprobs": [-0.5] * 7,
        "policy_versions": [(0, 0)],
        "content": "The lighthouse keeper looked out at the sea and saw a ship far away in the storm",
        "usage": Usage(prompt_tokens=500, completion_tokens=7),
        "sampling": SAMPLING,
        "started_at": time.time() - 0.4,
        "time_to_first_token_s": 0.0123,
        "duration_s": 0.3456,
        "matches_full_render": True,
        "fallback_reason": None,
        "finish_reason": "stop",
    }
    fields.update(overrides)
    return TurnCompleted.model_validate(fields)


def _conversation(session: str) -> list[Event]:
    """What one short session publishes: opened, one turn, feedback, closed."""
    return [
        SessionOpened.model_validate({**_base(session, 0), "agent": "pytest", "metadata": {"group": "g1"}}),
        TurnStarted.model_validate(
            {
                **_base(session, 1),
                "turn_id": f"{session}-t1",
                "parent_turn_id": None,
                "request_id": "chatcmpl-1",
                "choice_index": 0,
                "prompt_tokens": 500,
                "reused_prompt_tokens": 0,
                "sampling": SAMPLING,
            }
        ),
        _completed(session, f"{session}-t1"),
        FeedbackRecorded.model_validate(
            {**_base(session, 3), "turn_id": f"{session}-t1", "score": 0.75, "label": "good", "comment": "nice"}
        ),
        SessionClosed.model_validate({**_base(session, 4), "reason": "client", "turns": 1}),
    ]


@pytest.fixture
def server() -> Iterator[EmbeddedNatsServer]:
    """A server of our own per test: the tail tests count every event in the stream."""
    with EmbeddedNatsServer() as running:
        yield running


@pytest.fixture
async def publisher(server: EmbeddedNatsServer, tmp_path: Path) -> AsyncIterator[EventPublisher]:
    """The real publisher on ``server`` (it connects in the background)."""
    config = PublisherConfig(servers=(server.url,), outbox_dir=tmp_path / "outbox")
    async with EventPublisher(config) as running:
        yield running


async def _publish(publisher: EventPublisher, events: list[Event]) -> None:
    for event in events:
        publisher.publish_nowait(event)
    with anyio.fail_after(10):
        await publisher.wait_published()


async def _tail(server: EmbeddedNatsServer, flt: TailFilter, limit: int) -> list[str]:
    lines: list[str] = []
    with anyio.fail_after(10):
        count = await tail_events([server.url], SPEC, flt, lines.append, limit=limit)
    assert count == limit
    return lines


async def _wait_for_the_tails_consumer(server: EmbeddedNatsServer) -> None:
    """Until the tail has its consumer: its start sequence is fixed, so what is published now is new to it."""

    def exists() -> bool:
        return int(server.monitor("jsz")["consumers"]) > 0  # a server per test: the tail's is the only one

    await anyio.to_thread.run_sync(lambda: wait_until(exists, "the tail's consumer", timeout=20))


def _kinds(lines: list[str]) -> list[str]:
    return [line.split()[1] for line in lines]


@contextmanager
def _refused_port() -> Iterator[int]:
    """A loopback port bound but not listening while the block runs: connects are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_public_names() -> None:
    assert tail.__all__ == sorted(tail.__all__)
    assert set(tail.__all__) == {"KNOWN_KINDS", "TailError", "TailFilter", "format_event", "tail_events"}


@pytest.mark.anyio
async def test_from_start_replays_in_order_and_limit_stops(
    server: EmbeddedNatsServer, publisher: EventPublisher
) -> None:
    await _publish(publisher, _conversation("s1") + _conversation("s2"))

    lines = await _tail(server, TailFilter(from_start=True), limit=7)

    assert _kinds(lines) == [
        "session.opened",
        "turn.started",
        "turn.completed",
        "feedback.recorded",
        "session.closed",
        "session.opened",
        "turn.started",
    ]
    assert all("session=s1" in line for line in lines[:5])
    assert all("session=s2" in line for line in lines[5:])


@pytest.mark.anyio
async def test_filter_by_session_and_by_kinds(server: EmbeddedNatsServer, publisher: EventPublisher) -> None:
    await _publish(publisher, _conversation("s1") + _conversation("s2") + _conversation("s3"))

    by_session = await _tail(server, TailFilter(session="s2", from_start=True), limit=5)
    assert all("session=s2" in line for line in by_session)
    assert _kinds(by_session)[0] == "session.opened"

    kinds = ("turn.completed", "feedback.recorded")
    by_kind = await _tail(server, TailFilter(kinds=kinds, from_start=True), limit=6)
    assert _kinds(by_kind) == list(kinds) * 3
    assert [line.split()[2] for line in by_kind[::2]] == ["session=s1", "session=s2", "session=s3"]

    both = await _tail(server, TailFilter(session="s3", kinds=("session.closed",), from_start=True), limit=1)
    assert _kinds(both) == ["session.closed"] and "session=s3" in both[0]


@pytest.mark.anyio
async def test_filter_by_tenant_and_unsafe_session_ids(server: EmbeddedNatsServer, publisher: EventPublisher) -> None:
    other = SessionOpened.model_validate(_base("s1", tenant="anonymous"))
    odd_session = "user@example.com/session 1"  # appears in subjects as a digest
    await _publish(publisher, [other, *_conversation(odd_session)])

    by_tenant = await _tail(server, TailFilter(tenant="anonymous", from_start=True), limit=1)
    assert "session=s1" in by_tenant[0]

    odd = await _tail(server, TailFilter(session=odd_session, kinds=("session.closed",), from_start=True), limit=1)
    assert f"session={odd_session}" in odd[0]


@pytest.mark.anyio
async def test_only_new_events_without_from_start(server: EmbeddedNatsServer, publisher: EventPublisher) -> None:
    await _publish(publisher, _conversation("old"))
    lines: list[str] = []

    async def watch(task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await tail_events([server.url], SPEC, TailFilter(), lines.append, limit=5)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(watch)
            await _wait_for_the_tails_consumer(server)
            await _publish(publisher, _conversation("new"))
    assert len(lines) == 5
    assert all("session=new" in line for line in lines)


@pytest.mark.anyio
async def test_live_deltas(server: EmbeddedNatsServer, publisher: EventPublisher) -> None:
    delta = TurnDelta.model_validate(
        {**_base("s1"), "turn_id": "s1-t1", "offset": 16, "token_ids": [1, 2, 3, 4], "logprobs": [-0.1] * 4}
    )
    lines: list[str] = []

    async def watch(task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await tail_events([server.url], SPEC, TailFilter(kinds=("turn.delta",)), lines.append, limit=1)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(watch)
            while not lines:  # core NATS keeps nothing: publish until the tail is listening
                publisher.publish_nowait(delta)
                await anyio.sleep(0.1)
    assert "turn.delta" in lines[0] and "+4 tokens @16" in lines[0] and "turn=s1-t1" in lines[0]


@pytest.mark.anyio
async def test_undecodable_message_is_reported_and_skipped(
    server: EmbeddedNatsServer, publisher: EventPublisher
) -> None:
    good = _conversation("s1")[0]
    async with await nats.connect(server.url, max_reconnect_attempts=1) as nc:
        js = nc.jetstream()
        await ensure_stream(js, SPEC)
        await js.publish(event_subject(SPEC.prefix, good), b'{"kind": "turn.completed", "nonsense": 1}')
        await js.publish(event_subject(SPEC.prefix, good), b"not json")
    await _publish(publisher, [good])

    lines = await _tail(server, TailFilter(from_start=True), limit=1)
    assert len(lines) == 3
    assert lines[0].startswith("!! undecodable message on sg.events.") and "ValidationError" in lines[0]
    assert lines[1].startswith("!! undecodable")
    assert _kinds(lines[2:]) == ["session.opened"]


@pytest.mark.anyio
async def test_large_event_is_resolved_from_the_object_store(
    server: EmbeddedNatsServer, publisher: EventPublisher
) -> None:
    huge = _completed(
        "s1", "s1-t1", prompt_ids=list(range(300_000)), usage=Usage(prompt_tokens=300_000, completion_tokens=7)
    )
    assert len(encode_event(huge)) > 1024 * 1024
    await _publish(publisher, [huge])
    assert publisher.statistics().large == 1

    lines = await _tail(server, TailFilter(from_start=True), limit=1)
    assert "turn.completed" in lines[0] and "prompt=300000" in lines[0]


@pytest.mark.anyio
async def test_unreachable_server_fails_after_a_few_attempts_with_a_clear_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="pipeline.tail")
    refused = pytest.raises(TailError, match=r"cannot connect to NATS at nats://127\.0\.0\.1")
    with _refused_port() as port, anyio.fail_after(30), refused:
        await tail_events([f"nats://127.0.0.1:{port}"], SPEC, TailFilter(), print)
    # Each refused attempt reaches the client's error callback: the first try and two retries, not
    # nats-py's default of sixty, two seconds apart.
    attempts = [r for r in caplog.records if r.getMessage().startswith("NATS client error: ConnectionRefusedError")]
    assert len(attempts) == 3


@pytest.mark.anyio
async def test_missing_stream_is_a_clear_error(server: EmbeddedNatsServer) -> None:
    with anyio.fail_after(10), pytest.raises(TailError, match="stream SG_EVENTS does not exist"):
        await tail_events([server.url], SPEC, TailFilter(), print)


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown event kind"):
        TailFilter(kinds=("turn.finished",))


def test_filter_subjects() -> None:
    assert TailFilter().event_subjects("sg") == ["sg.events.*.*.>"]
    assert TailFilter().live_subject("sg") is None
    assert TailFilter(session="s1", kinds=("turn.completed", "session.closed")).event_subjects("sg") == [
        "sg.events.*.s1.session.closed",
        "sg.events.*.s1.turn.completed",
    ]
    live = TailFilter(tenant="anonymous", live=True)
    assert live.event_subjects("sg") == ["sg.events.anonymous.*.>"]
    assert live.live_subject("sg") == "sg.live.anonymous.*.turn.delta"
    assert TailFilter(kinds=("turn.delta",)).event_subjects("sg") == []


# -- format_event ----------------------------------------------------------------------------


def _line(event: Event) -> str:
    line = format_event(event)
    assert LINE_START.match(line), line
    assert "\n" not in line and "\x1b" not in line
    assert event.kind in line
    return line


def test_format_turn_completed() -> None:
    line = _line(_completed("s1", "t1"))
    for part in ("session=s1", "turn=t1", "stop", "prompt=500", "completion=7", "ttft=12ms", "duration=346ms"):
        assert part in line
    assert "'The lighthouse keeper looked out at the sea and saw a ship f'…" in line

    tools = [ToolCallRecord(id="c1", name="read", arguments="{}"), ToolCallRecord(id="c2", name="write", arguments="")]
    line = _line(_completed("s1", "t2", finish_reason="tool_calls", tool_calls=tools, content="line\nbreak"))
    assert "tool_calls" in line and "tools=[read, write]" in line and "lighthouse" not in line


def test_format_turn_aborted_and_started_and_delta() -> None:
    completed = _completed("s1", "t1").model_dump()
    del completed["finish_reason"]
    aborted = TurnAborted.model_validate(
        {**completed, "kind": "turn.aborted", "reason": "engine_error", "detail": "CUDA out of memory"}
    )
    line = _line(aborted)
    assert "engine_error ('CUDA out of memory')" in line and "completion=7" in line

    started = _conversation("s1")[1]
    line = _line(started)
    assert "turn=s1-t1" in line and "root" in line and "prompt=500" in line and "max_tokens=64" in line

    delta = TurnDelta.model_validate(
        {**_base("s1"), "turn_id": "t1", "offset": 8, "token_ids": [5, 6], "logprobs": [0, 0]}
    )
    assert "+2 tokens @8" in _line(delta)


def test_format_session_feedback_and_policy() -> None:
    opened, _, _, feedback, closed = _conversation("s1")
    assert "agent='pytest'" in _line(opened) and "group=g1" in _line(opened)
    line = _line(feedback)
    assert "score=0.75" in line and "label=good" in line and "source=user" in line and "'nice'" in line
    whole = FeedbackRecorded.model_validate({**_base("s1"), "turn_id": None, "score": -1, "source": "judge"})
    assert "score=-1" in _line(whole) and "(whole session)" in _line(whole) and "source=judge" in _line(whole)
    assert "reason=client turns=1" in _line(closed)
    policy = PolicyUpdated.model_validate({**_base(None, tenant="_"), "previous_version": 2, "weights": "/ckpt/4"})
    line = _line(policy)
    assert "session=-" in line and "published v3 (full, 0 files, 0.0 MiB) weights=/ckpt/4" in line
    applied = PolicyApplied.model_validate(
        {**_base(None, tenant="_"), "replica": "g1", "previous_version": 2, "source": "nats", "tensors": 3}
        | {"download_s": 0.25, "apply_s": 0.01, "pause_s": 0.0042, "copy_s": 0.001, "in_flight": 2}
    )
    assert "replica=g1 v2 -> v3 pause=4.2ms download=250ms in_flight=2" in _line(applied)
    rejected = PolicyRejected.model_validate(
        {**_base(None, tenant="_"), "replica": "g2", "rejected_version": 9, "reason": "shape_mismatch"}
        | {"detail": "x has shape (3,)"}
    )
    assert "replica=g2 refused v9 (shape_mismatch): x has shape (3,)" in _line(rejected)
    spanning = _completed("s1", "t1", policy_versions=[(3, 0), (4, 5)])
    assert "policies=v3@0,v4@5" in _line(spanning)


def test_format_color() -> None:
    line = format_event(_completed("s1", "t1"), color=True)
    assert "\x1b[32mturn.completed" in line and line.count("\x1b[0m") == 2


class _Screen:
    """What ``tail_events`` wrote, and a way to wait for a line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._written = anyio.Event()

    def write(self, line: str) -> None:
        self.lines.append(line)
        self._written.set()
        self._written = anyio.Event()

    async def wait_for(self, text: str) -> None:
        while not any(text in line for line in self.lines):
            await self._written.wait()


@pytest.mark.anyio
async def test_runs_until_cancelled_and_survives_a_server_restart(
    server: EmbeddedNatsServer, publisher: EventPublisher
) -> None:
    screen = _Screen()

    async def watch(task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await tail_events([server.url], SPEC, TailFilter(kinds=("session.opened",)), screen.write)

    await _publish(publisher, _conversation("before")[:1])  # the stream exists before the tail starts
    with anyio.fail_after(40):
        async with anyio.create_task_group() as tg:
            await tg.start(watch)
            await _wait_for_the_tails_consumer(server)
            await _publish(publisher, _conversation("s1"))
            await screen.wait_for("session=s1")
            await anyio.to_thread.run_sync(server.kill)
            await anyio.to_thread.run_sync(server.restart)
            await _publish(publisher, _conversation("s2"))
            await screen.wait_for("session=s2")
            tg.cancel_scope.cancel()
    events = [line for line in screen.lines if not line.startswith("--")]
    assert [line.split()[2] for line in events] == ["session=s1", "session=s2"]
    assert "-- connection to NATS lost; reconnecting" in screen.lines
    assert "-- connection to NATS back" in screen.lines
