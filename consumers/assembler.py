"""The trajectory assembler: events in, each session's trajectories out, exactly once.

Instances share one durable pull consumer on the events stream (JetStream hands each message
to one of them). None of them keeps a session in memory: a session's state is a small record in
a JetStream key-value bucket holding *references* (stream sequence numbers) to its events, the
``seq`` of its ``session.closed`` if any, and timers. Updates are compare-and-set, so two
instances receiving events of one session never lose each other's writes. When a session is
due, the instance that notices loads the referenced events from the stream, builds the
trajectories (:func:`consumers.trajectories.build_trajectories`), publishes each one with its
deterministic id as ``Nats-Msg-Id``, then marks the session emitted.

A session is due when:

* **closed**: its ``session.closed`` arrived and every ``seq`` before it too (events may come
  out of order; gateway replicas sharing a session number from blocks of their own, and its
  ``session.closed`` lists the numbers that exist in ``expected_seqs``); if some never come,
  after ``close_grace_s`` it is emitted marked incomplete. With
  ``reward_wait_s`` a closed session without session-level feedback waits that long for one;
* **idle**: no event for ``idle_timeout_s`` (the gateway evicts idle sessions too and says so
  with ``session.closed`` reason ``idle``; this covers gateways that died);
* **cap**: it reached ``max_turns`` turns: emitted then, truncated and marked; later events of
  the session are acknowledged and counted as late.

Exactly once, under crashes at any point: a message is acknowledged only after its effect is
durable: after the state record that references it is stored, and, for the message that makes
a session due, after the trajectories are published and the session is marked emitted. A
crash before the state write: the message is redelivered (after ``ack_wait_s``) and merged
again (merging is idempotent: refs are keyed by ``seq``). A crash after publishing but before
marking: the redelivered message publishes the same trajectory ids again, which JetStream drops
as duplicates (its duplicate window, 10 minutes by default, must exceed ``ack_wait_s``). A crash
after marking: the state says emitted; the message is just acknowledged.

Memory holds only the current fetch batch and, per open session this instance has seen, its
deadline (a float): state lives in the bucket. A restarted instance scans the bucket's keys once
to find the deadlines of sessions it never saw.

A mixture-of-experts session's routes (``routed_experts`` of its turn events) become each
trajectory's :attr:`~consumers.trajectory.Trajectory.routed_experts`
(:func:`consumers.trajectories.chain_routes`); large events were put in the object store by the
publisher and are resolved on reading. A chain whose routes do not join up is emitted without
routes, logged and counted (``unrouted``), never refused. A vision-language chain carries its
images (:func:`consumers.trajectories.chain_images`); one whose images do not line up with its
ids is left out, logged and counted (``images_refused``): it could not be trained on.

The pull loop is the batcher's too (:mod:`consumers._runner`); programmatic rewards are
:mod:`consumers.rewards`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import anyio
import orjson
from pipeline.connection import NatsAuth
from pipeline.durable import publish_durable
from pipeline.events import Event, decode_event, subject_token
from pipeline.subscriber import decode_message, message_payload
from pipeline.tombstones import Tombstones

from ._runner import DurableRunner, PullSpec
from .rewards import apply_reward, load_reward_function
from .streams import ConsumerStreams
from .trajectories import SessionEvents, build_trajectories
from .trajectory import Trajectory, erased

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

_RESTART_S = 1.0  # between a run a NATS error ended and the next

__all__ = ["Assembler", "AssemblerConfig", "AssemblerStatistics", "load_reward_function", "run_assembler"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AssemblerConfig:
    """How sessions become trajectories."""

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    auth: NatsAuth = field(default_factory=NatsAuth)  # credentials and TLS
    names: ConsumerStreams = field(default_factory=ConsumerStreams)
    durable: str = "assembler"
    idle_timeout_s: float = 900.0
    close_grace_s: float = 30.0
    reward_wait_s: float = 0.0
    default_reward: float | None = None  # for sessions with no feedback and no reward function result
    reward_function: str | None = None  # "module:function", called per trajectory, may be async
    reward_timeout_s: float = 10.0
    aborted: Literal["drop", "keep"] = "drop"
    # A sampled turn two chains share (a retry, an edit, n > 1): in the loss of one of them ("once",
    # the first by start time) or of every one ("every"): docs/trajectories.md.
    shared_turns: Literal["once", "every"] = "once"
    max_turns: int | None = None
    max_tokens: int | None = None
    ack_wait_s: float = 60.0
    fetch_batch: int = 256
    sweep_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class AssemblerStatistics:
    """Counters since start."""

    events: int
    sessions_emitted: int
    trajectories: int
    late_events: int
    sessions_waiting: int  # open sessions this instance holds a deadline for
    rewards_pending: int  # closed sessions waiting for feedback
    conflicts: int  # compare-and-set retries (another instance wrote first)
    unrouted: int = 0  # trajectories emitted without routes although some of their turns had them
    images_refused: int = 0  # chains left out because their images do not line up with their ids
    erased: int = 0  # events and sessions not assembled: forgotten (stream-gateway forget)
    revisions: int = 0  # trajectories published again with a late reward (feedback after emission)
    health: dict[str, int] = field(default_factory=dict)  # emitted trajectories per record-health flag
    end_reasons: dict[str, int] = field(default_factory=dict)  # emitted trajectories per end reason


class Assembler:
    """One assembler instance; ``await run()`` until cancelled."""

    def __init__(self, config: AssemblerConfig, progress: Callable[[str], None] | None = None) -> None:
        self._config = config
        self._progress = progress
        self._reward_function = load_reward_function(config.reward_function) if config.reward_function else None
        self._deadlines: dict[str, float] = {}  # state key -> when to look at the session again
        self._waiting_reward: set[str] = set()
        self._limiter = anyio.CapacityLimiter(32)  # sessions of one fetch handled at once
        self._events = self._emitted = self._trajectories = self._late = self._conflicts = self._unrouted = 0
        self._images_refused = self._erased = self._revisions = 0
        self._health: dict[str, int] = {}
        self._end_reasons: dict[str, int] = {}
        self._tombstones = Tombstones(config.names.prefix, replicas=config.names.replicas)  # never assembled
        self._last_report = time.monotonic()
        self._last_line = ""
        spec = PullSpec(
            stream=config.names.events,
            subjects=config.names.event_subjects,
            durable=config.durable,
            ack_wait_s=config.ack_wait_s,
            max_ack_pending=max(config.fetch_batch * 8, 1024),
            fetch_timeout_s=config.sweep_interval_s,
            sole_reader=False,  # instances share the durable
            ride_out_disconnects=False,  # nothing is held between fetches
        )
        self._runner = DurableRunner(
            spec, servers=config.servers, auth=config.auth, names=config.names, role="assembler", log=log
        )

    def statistics(self) -> AssemblerStatistics:
        """A snapshot of the counters."""
        return AssemblerStatistics(
            events=self._events,
            sessions_emitted=self._emitted,
            trajectories=self._trajectories,
            late_events=self._late,
            sessions_waiting=len(self._deadlines),
            rewards_pending=len(self._waiting_reward),
            conflicts=self._conflicts,
            unrouted=self._unrouted,
            images_refused=self._images_refused,
            erased=self._erased,
            revisions=self._revisions,
            health=dict(self._health),
            end_reasons=dict(self._end_reasons),
        )

    async def run(self) -> None:
        """Consume, assemble and publish until cancelled."""
        async with self._runner.connected() as (nc, js):
            kv = await js.key_value(self._config.names.state_bucket)
            subscription = await self._runner.bind(js)
            await self._tombstones.load(js)
            await self._load_deadlines(kv)
            work = _Work(nc, js, kv)
            self._last_report = time.monotonic()
            pending = await nc.subscribe(self._config.names.pending_subject, cb=partial(self._on_pending, kv))
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._tombstones.follow, js)
                    consume = partial(self._on_fetch, work)
                    await self._runner.consume(subscription, consume, lambda: self._config.fetch_batch)
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await pending.unsubscribe()

    async def _on_pending(self, kv: KeyValue, msg: Msg) -> None:
        """``stream-gateway pending``: each session this instance waits on, and what for (read only)."""
        config, now = self._config, time.time()
        sessions = []
        for key, due in sorted(self._deadlines.items(), key=lambda item: item[1])[:500]:
            try:
                state = orjson.loads((await kv.get(key)).value or b"{}")
            except Exception:  # gone meanwhile (emitted, forgotten): not waiting any more
                continue
            if not state or state.get("emitted"):
                continue
            kinds = state["kinds"].values()
            closed = state["closed_seq"] is not None
            if not closed:
                why = f"close, or {config.idle_timeout_s:g} s without a request"
            elif key in self._waiting_reward:
                why = f"feedback (--reward-wait {config.reward_wait_s:g} s)"
            else:
                why = f"late events ({config.close_grace_s:g} s after close)"
            sessions.append({
                "session_id": state["session_id"], "turns": sum(k in ("turn.completed", "turn.aborted") for k in kinds),
                "feedback": sum(k == "feedback.recorded" for k in kinds), "closed": closed,
                "waiting_for": why, "due_in_s": round(max(0.0, due - now), 1),
                "reward_if_none": config.default_reward,
            })  # fmt: skip
        if msg.reply:
            await msg.respond(orjson.dumps({"role": "assembler", "sessions": sessions}))

    async def _on_fetch(self, work: _Work, messages: list[Msg]) -> None:
        """One fetch's messages (maybe none), then whatever came due, then the progress line."""
        if messages:
            await self._handle(work, messages)
        await self._sweep(work)
        if self._progress is not None and time.monotonic() - self._last_report >= 10:
            self._last_report = time.monotonic()
            s = self.statistics()
            line = (
                f"assembler: {s.events} events, {s.sessions_waiting} sessions open, "
                f"{s.sessions_emitted} emitted ({s.trajectories} trajectories), "
                f"{s.rewards_pending} waiting for rewards"
                + (f", {s.unrouted} without routes" if s.unrouted else "")
                + (f", {s.images_refused} left out for their images" if s.images_refused else "")
            )
            if line != self._last_line:  # an idle assembler says nothing new every 10 s (issue 43)
                self._last_line = line
                self._progress(line)

    # -- consuming -------------------------------------------------------------------------------

    async def _handle(self, work: _Work, messages: list[Msg]) -> None:
        by_session: dict[str, list[tuple[Msg, dict[str, Any]]]] = {}
        in_hand: dict[int, bytes] = {}  # stream sequence -> event JSON, so emitting needs no re-read
        for msg in messages:
            self._events += 1
            try:
                payload = await message_payload(msg, work.js)
                body = orjson.loads(payload)
                session_id, tenant, seq, kind = body["session_id"], body["tenant"], body["seq"], body["kind"]
            except Exception:
                log.exception("undecodable message %s on %s: skipped", msg.metadata.sequence.stream, msg.subject)
                await msg.ack()
                continue
            if session_id is None:  # policy.updated and the like: not part of any trajectory
                await msg.ack()
                continue
            if erased(self._tombstones, tenant, session_id):  # forgotten: a late copy, never assembled
                self._erased += 1
                await msg.ack()
                continue
            key = f"s.{subject_token(tenant)}.{subject_token(session_id)}"
            ref = msg.metadata.sequence.stream
            in_hand[ref] = payload
            entry = {"seq": seq, "kind": kind, "ref": ref, "session_id": session_id, "tenant": tenant}
            if kind == "session.closed" and body.get("expected_seqs") is not None:
                entry["expected"] = body["expected_seqs"]
            by_session.setdefault(key, []).append((msg, entry))

        async def one_session(key: str, items: list[tuple[Msg, dict[str, Any]]]) -> None:
            async with self._limiter:
                state, revision = await self._merge(work, key, [entry for _, entry in items])
                if not state.get("emitted"):
                    await self._emit_if_due(work, key, state, revision, in_hand=in_hand)
                elif state.get("late_refs"):
                    await self._emit_revision(work, key, state, revision, in_hand)
                for msg, _ in items:
                    await msg.ack()

        # Sessions are independent keys: their round trips overlap.
        async with anyio.create_task_group() as tg:
            for key, items in by_session.items():
                tg.start_soon(one_session, key, items)

    async def _merge(self, work: _Work, key: str, entries: list[dict[str, Any]]) -> tuple[dict[str, Any], int | None]:
        """Add the entries' refs to the session's state record (compare-and-set); it and its revision."""
        now = time.time()
        while True:
            state, revision = await work.load(key)
            if state is None:
                state = {"session_id": entries[0]["session_id"], "tenant": entries[0]["tenant"], "refs": {}}
                state |= {"kinds": {}, "closed_seq": None, "closed_at": None, "emitted": False}
            if state["emitted"]:
                # Feedback after emission is kept: the session's trajectories it changes are emitted
                # again as a new revision (late rewards, docs/trajectories.md). Anything else is late.
                feedback = [
                    e for e in entries if e["kind"] == "feedback.recorded" and str(e["seq"]) not in state["refs"]
                ]
                self._late += len(entries) - len(feedback)
                if not feedback:
                    return state, revision
                late = dict(state.get("late_refs") or {})
                for entry in feedback:
                    late[str(entry["seq"])] = entry["ref"]
                state = state | {"late_refs": late}
                stored = await work.store(key, state, revision)
                if stored is not None:
                    return state, stored
                self._conflicts += 1
                continue
            for entry in entries:
                seq = str(entry["seq"])
                state["refs"][seq] = entry["ref"]
                state["kinds"][seq] = entry["kind"]
                if entry["kind"] == "session.closed" and state["closed_seq"] is None:
                    state["closed_seq"], state["closed_at"] = entry["seq"], now
                    state["expected"] = entry.get("expected")
            state["seen_at"] = now
            stored = await work.store(key, state, revision)
            if stored is not None:
                self._deadlines[key] = self._deadline(state)
                return state, stored
            self._conflicts += 1

    def _deadline(self, state: dict[str, Any]) -> float:
        config = self._config
        if state["closed_seq"] is None:
            return float(state["seen_at"]) + config.idle_timeout_s
        return float(state["closed_at"]) + max(config.close_grace_s, config.reward_wait_s)

    async def _sweep(self, work: _Work) -> None:
        now = time.time()
        for key in [k for k, due in self._deadlines.items() if due <= now]:
            state, revision = await work.load(key)
            if state is None or state["emitted"]:
                self._deadlines.pop(key, None)
                continue
            await self._emit_if_due(work, key, state, revision, timed_out=True)

    async def _load_deadlines(self, kv: KeyValue) -> None:
        from pipeline.kv import current_entries

        for entry in (await current_entries(kv)).values():  # not kv.keys(): it can miss keys (pipeline/kv.py)
            key, state = entry.key, orjson.loads(entry.value or b"{}")
            if state and not state.get("emitted"):
                self._deadlines[key] = self._deadline(state)

    # -- emitting --------------------------------------------------------------------------------

    def _count_unrouted(self, reason: str) -> None:
        self._unrouted += 1

    def _count_refused_images(self, reason: str) -> None:
        self._images_refused += 1

    async def _emit_if_due(
        self,
        work: _Work,
        key: str,
        state: dict[str, Any],
        revision: int | None,
        *,
        timed_out: bool = False,
        in_hand: dict[int, bytes] | None = None,
    ) -> None:
        config = self._config
        kinds: dict[str, str] = state["kinds"]
        turns = sum(kind in ("turn.completed", "turn.aborted") for kind in kinds.values())
        closed_seq = state["closed_seq"]
        because: Literal["closed", "idle", "cap"]
        complete = True
        if config.max_turns is not None and turns >= config.max_turns:
            because = "cap"
        elif closed_seq is not None:
            expected = state.get("expected")
            wanted = range(closed_seq) if expected is None else (s for a, b in expected for s in range(a, b))
            complete = all(str(s) in kinds for s in wanted)
            has_feedback = "feedback.recorded" in kinds.values()
            waited = time.time() - float(state["closed_at"])
            if not complete and waited < config.close_grace_s:
                return
            if not has_feedback and config.reward_wait_s and waited < config.reward_wait_s:
                self._waiting_reward.add(key)
                return
            because = "closed"
        elif timed_out:
            because = "idle"
            complete = all(str(s) in kinds for s in range(len(kinds)))
        else:
            return
        await self._emit(work, key, state, revision, because, complete, in_hand or {})

    async def _emit(
        self,
        work: _Work,
        key: str,
        state: dict[str, Any],
        revision: int | None,
        because: Literal["closed", "idle", "cap"],
        complete: bool,
        in_hand: dict[int, bytes],
    ) -> None:
        import nats.errors

        names = self._config.names
        try:
            await self._tombstones.current(work.js)
        except (nats.errors.Error, TimeoutError) as exc:  # NATS away: emitted at a later sweep
            log.debug("assembler: tombstones not checked (%r); session %s waits", exc, state["session_id"])
            return
        if erased(self._tombstones, state["tenant"], state["session_id"]):  # forgotten meanwhile: nothing of it
            self._deadlines.pop(key, None)
            self._waiting_reward.discard(key)
            self._erased += 1
            return
        events = await self._events_of(work, state["refs"].values(), in_hand)
        trajectories = await self._build(events, because, complete)
        for trajectory in trajectories:
            await publish_durable(
                work.nc,
                work.js,
                names.trajectory_subject(trajectory),
                trajectory.trajectory_id,
                trajectory.encode(),
                bucket=names.payload_bucket,
            )
        current: dict[str, Any] | None = state
        while True:  # mark emitted; a concurrent writer only ever adds refs, which come too late now
            if current is None or current["emitted"]:
                break
            current = current | {
                "emitted": True,
                "emitted_because": because,
                "complete": complete,
                "trajectory_ids": [t.trajectory_id for t in trajectories],
            }
            if await work.store(key, current, revision) is not None:
                break
            self._conflicts += 1
            current, revision = await work.load(key)
        self._deadlines.pop(key, None)
        self._waiting_reward.discard(key)
        self._emitted += 1
        self._trajectories += len(trajectories)
        for trajectory in trajectories:
            for flag in trajectory.health:
                self._health[flag] = self._health.get(flag, 0) + 1
            reason = trajectory.end_reason or "unknown"
            self._end_reasons[reason] = self._end_reasons.get(reason, 0) + 1
        log.info("session %s: %d trajectories (%s)", state["session_id"], len(trajectories), because)

    async def _events_of(self, work: _Work, refs: Iterable[int], in_hand: dict[int, bytes]) -> list[Event]:
        """The events at ``refs`` in the events stream: from ``in_hand`` or read back, at once."""
        wanted = list(refs)
        events = [decode_event(in_hand[ref]) for ref in wanted if ref in in_hand]

        async def fetch(ref: int) -> None:
            raw = await work.js.get_msg(self._config.names.events, ref)
            events.append(await decode_message(raw, work.js))  # type: ignore[arg-type]

        async with anyio.create_task_group() as tg:  # earlier events of the session: read back at once
            for ref in wanted:
                if ref not in in_hand:
                    tg.start_soon(fetch, ref)
        return events

    async def _build(
        self, events: list[Event], because: Literal["closed", "idle", "cap"], complete: bool
    ) -> list[Trajectory]:
        config = self._config
        trajectories = build_trajectories(
            SessionEvents.of(events),
            emitted_because=because,
            complete=complete,
            keep_aborted=config.aborted == "keep",
            shared_turns=config.shared_turns,
            max_turns=config.max_turns,
            max_tokens=config.max_tokens,
            default_reward=None if self._reward_function is not None else config.default_reward,
            on_unrouted=self._count_unrouted,
            on_refused_images=self._count_refused_images,
        )
        if self._reward_function is not None:  # only set with config.reward_function
            name, timeout_s = config.reward_function or "", config.reward_timeout_s
            trajectories = [
                await apply_reward(
                    t, self._reward_function, name=name, timeout_s=timeout_s, default_reward=config.default_reward
                )
                for t in trajectories
            ]
        return trajectories

    async def _emit_revision(
        self, work: _Work, key: str, state: dict[str, Any], revision: int | None, in_hand: dict[int, bytes]
    ) -> None:
        """Feedback that arrived after the session was emitted: each trajectory whose rewards it
        changes is published again, same id, ``revision`` one higher (``Nats-Msg-Id``
        ``<id>.r<revision>``, so a crash before the state is stored republishes the same copies,
        which JetStream drops). The batcher uses it if the old one is not in a batch yet, and
        otherwise records it as a late reward on that batch."""
        import nats.errors

        names = self._config.names
        try:
            await self._tombstones.current(work.js)
        except (nats.errors.Error, TimeoutError):
            return  # the feedback is in the state: a later message or a restart emits it
        if erased(self._tombstones, state["tenant"], state["session_id"]):
            return
        late: dict[str, int] = state["late_refs"]
        because, complete = state.get("emitted_because", "closed"), bool(state.get("complete", True))
        before = await self._build(await self._events_of(work, state["refs"].values(), in_hand), because, complete)
        after = await self._build(
            await self._events_of(work, [*state["refs"].values(), *late.values()], in_hand), because, complete
        )
        number = int(state.get("revisions", 0)) + 1
        old = {t.trajectory_id: t for t in before}
        changed = [t for t in after if t.trajectory_id not in old or _rewards(old[t.trajectory_id]) != _rewards(t)]
        for trajectory in changed:
            trajectory = trajectory.model_copy(update={"revision": number})
            await publish_durable(
                work.nc, work.js, names.trajectory_subject(trajectory), f"{trajectory.trajectory_id}.r{number}",
                trajectory.encode(), bucket=names.payload_bucket,
            )  # fmt: skip
        current: dict[str, Any] | None = state
        while current is not None:  # the late refs join the session's: the next feedback builds on them
            refs = {**current["refs"], **(current.get("late_refs") or {})}
            current = current | {"refs": refs, "late_refs": {}, "revisions": number}
            if await work.store(key, current, revision) is not None:
                break
            self._conflicts += 1
            current, revision = await work.load(key)
        self._revisions += len(changed)
        log.info("session %s: late feedback, revision %d of %d trajectories", state["session_id"], number, len(changed))


def _rewards(trajectory: Trajectory) -> tuple[float | None, tuple[float | None, ...]]:
    return trajectory.reward, tuple(s.reward for s in trajectory.turns)


@dataclass(slots=True)
class _Work:
    """The connection and bucket one run uses."""

    nc: Client
    js: JetStreamContext
    kv: KeyValue

    async def load(self, key: str) -> tuple[dict[str, Any] | None, int | None]:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None, None
        return orjson.loads(entry.value or b"{}"), entry.revision

    async def store(self, key: str, state: dict[str, Any], revision: int | None) -> int | None:
        """Write if nobody wrote since ``revision`` (``None``: if the key does not exist).

        Returns the new revision, or ``None`` if someone else wrote first.
        """
        from nats.js.errors import KeyWrongLastSequenceError

        data = orjson.dumps(state)
        try:
            if revision is None:
                return int(await self.kv.create(key, data))
            return int(await self.kv.update(key, data, last=revision))
        except KeyWrongLastSequenceError:
            return None


async def run_assembler(config: AssemblerConfig, progress: Callable[[str], None] | None = None) -> None:
    """Run one assembler instance until cancelled.

    A NATS error that ends a run (a KV write or a trajectory publish timing out while a cluster
    elects a leader, say) starts the next run a second later, on a new connection: the run holds
    nothing between fetches, and what it had not acknowledged is delivered again.
    """
    import nats.errors

    assembler = Assembler(config, progress)
    while True:
        try:
            await assembler.run()
        except* (nats.errors.Error, TimeoutError, ConnectionResetError) as group:  # a refusal: exit
            log.warning("assembler: NATS failed (%r); starting again in %.0f s", group.exceptions[0], _RESTART_S)
        await anyio.sleep(_RESTART_S)
