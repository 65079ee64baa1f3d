"""A gateway capturing into a real nats-server, and reading back what reached JetStream.

``capture_settings`` and ``capture_gateway`` are fixtures, offered to every test by ``tests/conftest.py``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from pipeline.connection import NatsAuth, connect
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import Event
from pipeline.subscriber import decode_message
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from .servers import RunningGateway, run_gateway

if TYPE_CHECKING:
    from consumers.trajectory import Trajectory

KEY = "sk-capture"


def read_stream(url: str, stream: str = "SG_EVENTS", auth: NatsAuth | None = None) -> list[tuple[str, Event]]:
    """Every message of the events stream, in stream order, as (subject, decoded event)."""

    async def fetch() -> list[tuple[str, Event]]:
        nc = await connect(url, auth, max_reconnect_attempts=2, reconnect_time_wait=0.2)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            out: list[tuple[str, Event]] = []
            if not info.state.messages:
                return out
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(stream, seq)
                out.append((msg.subject, await decode_message(msg, js)))  # type: ignore[arg-type]
            return out
        finally:
            await nc.close()

    return anyio.run(fetch)


def wait_for(url: str, done: Callable[[list[Event]], bool], timeout: float = 60.0) -> list[Event]:
    """Poll the stream until ``done(events)``; fail with what arrived if it never is."""
    deadline = time.monotonic() + timeout
    events: list[Event] = []
    while time.monotonic() < deadline:
        try:
            events = [e for _, e in read_stream(url)]
        except Exception:  # the stream may not exist yet
            events = []
        if done(events):
            return events
        time.sleep(0.2)
    raise AssertionError(f"stream never complete: {Counter(e.kind for e in events)}")


def of_session(events: list[Event], session_id: str) -> list[Event]:
    return [e for e in events if e.session_id == session_id]


def replica_settings(model: str, tmp_path: Path) -> Callable[..., Settings]:
    """``make(url, name, **overrides)``: settings of replica ``name`` serving the built-in ``model``,
    capturing to ``url`` with an outbox of its own under ``tmp_path``."""
    from stream_gateway.models import resolve_model

    def make(url: str, name: str = "a", **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "model": resolve_model(model),
            "served_model_name": model,
            "nats_url": url,
            "outbox_dir": tmp_path / f"outbox-{name}",
            "replica_id": name,
            **overrides,
        }
        return Settings(**values)

    return make


@pytest.fixture
def capture_settings(tiny_model_path: Path, tmp_path: Path) -> Callable[..., Settings]:
    def make(url: str, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "model": str(tiny_model_path),
            "served_model_name": "tiny",
            "nats_url": url,
            "outbox_dir": tmp_path / "outbox",
            **overrides,
        }
        return Settings(**values)

    return make


@pytest.fixture
def capture_gateway(
    nats_server: EmbeddedNatsServer, capture_settings: Callable[..., Settings]
) -> Iterator[RunningGateway]:
    settings = capture_settings(nats_server.url, delta_tokens=8, delta_interval_ms=60_000)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def read_trajectories(url: str, stream: str = "SG_TRAJECTORIES") -> list[Trajectory]:
    """Every trajectory message in the stream, in order (duplicates would show up twice)."""

    import nats
    from nats.js.errors import NotFoundError

    from consumers.trajectory import Trajectory
    from pipeline.subscriber import message_payload

    async def fetch() -> list[Trajectory]:
        nc = await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.2)
        try:
            js = nc.jetstream()
            try:
                info = await js.stream_info(stream)
            except NotFoundError:
                return []
            out: list[Trajectory] = []
            if not info.state.messages:
                return out
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(stream, seq)
                out.append(Trajectory.decode(await message_payload(msg, js)))  # type: ignore[arg-type]
            return out
        finally:
            await nc.close()

    return anyio.run(fetch)
