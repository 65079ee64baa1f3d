"""``stream-gateway tail``: a live, human-readable view of the events going through NATS.

:func:`tail_events` reads the events stream with an ephemeral ordered consumer (no state is
left on the server, nothing is acknowledged, a gap is healed by the client re-creating the
consumer) and, when asked, the core-NATS live subjects of ``turn.delta``; :func:`format_event`
turns each event into one line for a terminal.

Deliberate choices:

* **Filtering on the server.** The filter becomes subjects (``sg.events.<tenant>.<session>.<kind>``,
  see :mod:`pipeline.streams`): several kinds are several ``filter_subjects`` of one consumer
  (nats-server 2.10+), so a quiet session in a busy stream costs nothing to watch. The decoded
  event is checked again on the client, because a session id that is not a safe subject token
  appears in subjects as a digest of itself.
* **"Only new events" is a start sequence, not ``DeliverPolicy.NEW``.** The consumer starts at the
  stream's last sequence + 1 as read before subscribing, and anything older is skipped on the
  client: nats-py re-creates an ordered consumer that lost its heartbeats from "last sequence
  seen + 1", which is 1 (the whole stream) while nothing has been seen yet.
* **A bounded first connect, then patience.** nats-py retries even the first connect (about two
  minutes with its defaults); here it gives up after a few quick attempts with a :class:`TailError`.
  Once connected, reconnects are unlimited (``max_reconnect_attempts`` in the client's options is
  raised to -1) and announced as ``--`` lines: a watcher should survive a NATS restart.
* **Sessionless events** (``policy.updated``/``applied``/``rejected``, subject tenant and session ``_``) are shown only
  when neither a session nor a tenant is asked for.
* An event that cannot be decoded (bad JSON, a schema it does not match, a missing large-payload
  object) is reported as one ``!!`` line and not counted; the tail goes on.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from pipeline.errors import NatsRefused

from .connection import NatsAuth, close_quietly, connect
from .errors import TailError
from .events import (
    DURABLE_KINDS,
    Event,
    FeedbackRecorded,
    PolicyApplied,
    PolicyRejected,
    PolicyUpdated,
    SessionClosed,
    SessionOpened,
    TurnAborted,
    TurnCompleted,
    TurnDelta,
    TurnRecord,
    TurnStarted,
    subject_token,
)
from .streams import StreamSpec
from .subscriber import decode_message

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext

__all__ = ["KNOWN_KINDS", "TailError", "TailFilter", "format_event", "tail_events"]

log = logging.getLogger(__name__)

KNOWN_KINDS = frozenset(DURABLE_KINDS | {"turn.delta"})

_CONNECT_ATTEMPTS = 2  # retries after the first try, per server
_CONNECT_TIMEOUT_S = 2
_RECONNECT_WAIT_S = 0.2
_CLOSE_TIMEOUT_S = 2.0
# Two missed heartbeats make nats-py re-create the ordered consumer (e.g. after a NATS restart,
# which loses it): 1 s recovers within about 2 s instead of nats-py's default 10.
_HEARTBEAT_S = 1.0
_CONTENT_CHARS = 60
_COMMENT_CHARS = 60
_KIND_WIDTH = max(len(kind) for kind in KNOWN_KINDS)

_RESET = "\x1b[0m"
_DIM = "\x1b[2m"
_KIND_COLORS = {
    "session.opened": "\x1b[36m",  # cyan
    "session.closed": "\x1b[36m",
    "turn.started": "\x1b[34m",  # blue
    "turn.delta": "\x1b[2m",  # dim
    "turn.completed": "\x1b[32m",  # green
    "turn.aborted": "\x1b[31m",  # red
    "feedback.recorded": "\x1b[33m",  # yellow
    "policy.updated": "\x1b[35m",  # magenta
    "policy.applied": "\x1b[35m",
    "policy.rejected": "\x1b[31m",  # red
}


@dataclass(frozen=True, slots=True)
class TailFilter:
    """Which events to show. Empty fields match everything."""

    session: str | None = None  # a session id, as in events
    tenant: str | None = None  # a tenant id, as in events (``pipeline.events.tenant_id``)
    kinds: tuple[str, ...] = ()  # () = every durable kind; "turn.delta" implies ``live``
    live: bool = False  # also show turn.delta from the core-NATS live subjects
    from_start: bool = False  # replay the stream from its first event, not only new ones

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - KNOWN_KINDS)
        if unknown:
            raise ValueError(f"unknown event kind(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_KINDS))}")

    @property
    def wanted_kinds(self) -> frozenset[str]:
        """The kinds to show."""
        kinds = frozenset(self.kinds) if self.kinds else DURABLE_KINDS
        return kinds | {"turn.delta"} if self.live else kinds

    def event_subjects(self, prefix: str) -> list[str]:
        """The durable subjects to read (empty when only ``turn.delta`` is wanted)."""
        base = f"{prefix}.events.{self._scope()}"
        if not self.kinds:
            return [f"{base}.>"]
        return [f"{base}.{kind}" for kind in sorted(self.wanted_kinds & DURABLE_KINDS)]

    def live_subject(self, prefix: str) -> str | None:
        """The core-NATS subject of the wanted deltas, or ``None``."""
        return f"{prefix}.live.{self._scope()}.turn.delta" if "turn.delta" in self.wanted_kinds else None

    def matches(self, event: Event) -> bool:
        """Whether ``event`` passes the filter (the exact check behind the subject filter)."""
        return (
            event.kind in self.wanted_kinds
            and (self.session is None or event.session_id == self.session)
            and (self.tenant is None or event.tenant == self.tenant)
        )

    def _scope(self) -> str:
        tenant = "*" if self.tenant is None else subject_token(self.tenant)
        session = "*" if self.session is None else subject_token(self.session)
        return f"{tenant}.{session}"


# -- formatting ------------------------------------------------------------------------------


def format_event(event: Event, *, color: bool = False) -> str:
    """One line for a terminal: local time, kind, session, turn, and what matters for the kind."""
    stamp = datetime.fromtimestamp(event.time).strftime("%H:%M:%S.%f")[:-3]
    kind = f"{event.kind:<{_KIND_WIDTH}}"
    where = f"session={event.session_id or '-'}"
    turn_id = getattr(event, "turn_id", None)
    if turn_id is not None:
        where += f" turn={turn_id}"
    detail = _detail(event)
    if color:
        stamp = f"{_DIM}{stamp}{_RESET}"
        kind = f"{_KIND_COLORS.get(event.kind, '')}{kind}{_RESET}"
    return f"{stamp} {kind} {where}" + (f"  {detail}" if detail else "")


def _detail(event: Event) -> str:
    match event:
        case TurnCompleted():
            return f"{event.finish_reason} {_generation(event)}"
        case TurnAborted():
            reason = event.reason + (f" ({_clip(event.detail, _COMMENT_CHARS)})" if event.detail else "")
            return f"{reason} {_generation(event)}"
        case TurnStarted():
            parent = f"parent={event.parent_turn_id}" if event.parent_turn_id else "root"
            s = event.sampling
            return (
                f"{parent} prompt={event.prompt_tokens} reused={event.reused_prompt_tokens} "
                f"max_tokens={s.max_tokens} temperature={s.temperature:g}"
            )
        case TurnDelta():
            return f"+{len(event.token_ids)} tokens @{event.offset}"
        case FeedbackRecorded():
            parts = [f"score={event.score:g}"]
            if event.label is not None:
                parts.append(f"label={event.label}")
            parts.append(f"source={event.source}")
            if event.turn_id is None:
                parts.append("(whole session)")
            if event.comment:
                parts.append(_clip(event.comment, _COMMENT_CHARS))
            return " ".join(parts)
        case SessionClosed():
            return f"reason={event.reason} turns={event.turns}"
        case SessionOpened():
            parts = [f"agent={event.agent!r}"] if event.agent else []
            parts += [f"{key}={value}" for key, value in sorted(event.metadata.items())]
            return " ".join(parts)
        case PolicyUpdated():
            size = sum(o.size for o in event.objects) / 2**20
            weights = f" weights={event.weights}" if event.weights else ""
            kind = "full" if event.full else "partial"
            return (
                f"{_adapter(event.adapter)}published v{event.policy_version} ({kind}, {len(event.objects)} files, "
                f"{size:.1f} MiB){weights}"
            )
        case PolicyApplied():
            return (
                f"{_adapter(event.adapter)}replica={event.replica} "
                f"v{event.previous_version} -> v{event.policy_version} pause={event.pause_s * 1000:.1f}ms "
                f"download={event.download_s * 1000:.0f}ms in_flight={event.in_flight}"
            )
        case PolicyRejected():
            return (
                f"{_adapter(event.adapter)}replica={event.replica} refused v{event.rejected_version} "
                f"({event.reason}): {event.detail}"
            )
        case _:
            return ""


def _adapter(name: str | None) -> str:
    """The adapter a policy event is about, as a prefix (nothing for the base model)."""
    return f"adapter={name} " if name is not None else ""


def _generation(event: TurnRecord) -> str:
    usage = event.usage
    parts = [f"prompt={usage.prompt_tokens} completion={usage.completion_tokens}"]
    if event.tool_calls:
        parts.append("tools=[" + ", ".join(call.name for call in event.tool_calls) + "]")
    else:
        parts.append(_clip(event.content, _CONTENT_CHARS))
    if event.time_to_first_token_s is not None:
        parts.append(f"ttft={event.time_to_first_token_s * 1000:.0f}ms")
    parts.append(f"duration={event.duration_s * 1000:.0f}ms")
    if len(event.policy_versions) > 1:  # weights changed mid-turn: which tokens each version sampled
        parts.append("policies=" + ",".join(f"v{v}@{first}" for v, first in event.policy_versions))
    return " ".join(parts)


def _clip(text: str, chars: int) -> str:
    """``repr`` of the first ``chars`` characters: one line whatever the text holds."""
    return repr(text[:chars]) + ("…" if len(text) > chars else "")


# -- reading ---------------------------------------------------------------------------------


async def tail_events(
    servers: list[str],
    spec: StreamSpec,
    flt: TailFilter,
    write: Callable[[str], None],
    *,
    limit: int | None = None,
    color: bool = False,
    auth: NatsAuth | None = None,
) -> int:
    """Write one line per event matching ``flt`` until ``limit`` events (or until cancelled).

    Returns how many events were written. Raises :class:`TailError` when no server in
    ``servers`` can be reached within a few seconds, when the stream ``spec.stream`` does not
    exist, or when the connection is closed for good.
    """
    from nats.errors import Error as NatsError

    if limit is not None and limit <= 0:
        return 0
    count = 0
    async with _connected(servers, write, auth) as nc:
        js = nc.jetstream()
        subs = await _subscribe(nc, js, spec, flt)
        send, receive = anyio.create_memory_object_stream[tuple["Msg", int]](16)
        try:
            async with anyio.create_task_group() as tg, receive:
                for sub, start_seq in subs:
                    tg.start_soon(_forward, sub, start_seq, send.clone())
                send.close()
                async for msg, start_seq in receive:
                    if start_seq and msg.metadata.sequence.stream < start_seq:
                        continue  # older than the tail's start: see the module docstring
                    try:
                        event = await decode_message(msg, js)
                    except (ValueError, LookupError, NatsError) as exc:
                        write(f"!! undecodable message on {msg.subject}: {_reason(exc)}")
                        continue
                    if not flt.matches(event):
                        continue
                    write(format_event(event, color=color))
                    count += 1
                    if limit is not None and count >= limit:
                        tg.cancel_scope.cancel()
                        break
        finally:
            with anyio.move_on_after(_CLOSE_TIMEOUT_S, shield=True), suppress(NatsError):
                for sub, _ in subs:
                    await sub.unsubscribe()  # also stops nats-py's heartbeat and flow-control tasks
        if (limit is None or count < limit) and nc.is_closed:
            raise TailError(f"the connection to NATS at {', '.join(servers)} was closed")
    return count


async def _forward(sub: Subscription, start_seq: int, send: MemoryObjectSendStream[tuple[Msg, int]]) -> None:
    async with send:
        async for msg in sub.messages:
            await send.send((msg, start_seq))


async def _subscribe(
    nc: Client, js: JetStreamContext, spec: StreamSpec, flt: TailFilter
) -> list[tuple[Subscription, int]]:
    """The subscriptions to read, each with the stream sequence its events start at (0: any)."""
    from nats.errors import Error as NatsError
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    subs: list[tuple[Subscription, int]] = []
    subjects = flt.event_subjects(spec.prefix)
    if subjects:
        try:
            info = await js.stream_info(spec.stream)
        except NotFoundError as exc:
            raise TailError(f"stream {spec.stream} does not exist (nothing has published events yet?)") from exc
        except NatsError as exc:  # JetStream disabled, timeouts, permissions
            raise TailError(f"cannot read stream {spec.stream}: {_reason(exc)}") from exc
        if flt.from_start:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
            start_seq = 0
        else:
            start_seq = info.state.last_seq + 1
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq)
        if len(subjects) > 1:
            config.filter_subjects = subjects
        try:
            sub = await js.subscribe(
                subjects[0], stream=spec.stream, config=config, ordered_consumer=True, idle_heartbeat=_HEARTBEAT_S
            )
        except NatsError as exc:  # e.g. several filter subjects on a server older than 2.10
            raise TailError(f"cannot create a consumer on stream {spec.stream}: {_reason(exc)}") from exc
        subs.append((sub, start_seq))
    live = flt.live_subject(spec.prefix)
    if live is not None:
        subs.append((await nc.subscribe(live), 0))
    return subs


@asynccontextmanager
async def _connected(servers: list[str], write: Callable[[str], None], auth: NatsAuth | None) -> AsyncIterator[Client]:
    """A nats-py client whose first connect gives up quickly and whose reconnects never do."""
    closing = False

    async def disconnected() -> None:
        if not closing:
            write("-- connection to NATS lost; reconnecting")

    async def reconnected() -> None:
        write("-- connection to NATS back")

    async def error(exc: Exception) -> None:
        log.debug("NATS client error: %r", exc)

    try:
        nc = await connect(
            servers,
            auth,
            name="stream-gateway-tail",
            connect_timeout=_CONNECT_TIMEOUT_S,
            max_reconnect_attempts=_CONNECT_ATTEMPTS,
            reconnect_time_wait=_RECONNECT_WAIT_S,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
        )
    except NatsRefused as exc:
        raise TailError(str(exc)) from exc
    except Exception as exc:  # nats-py raises several unrelated types for "cannot connect"
        raise TailError(f"cannot connect to NATS at {', '.join(servers)}: {_reason(exc)}") from exc
    nc.options["max_reconnect_attempts"] = -1  # read on every reconnect: see the module docstring
    try:
        yield nc
    finally:
        closing = True
        await close_quietly(nc, _CLOSE_TIMEOUT_S)


def _reason(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
