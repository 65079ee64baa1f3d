"""The batcher: trajectories in, verl training batches out, each trajectory in exactly one batch.

One batcher reads ``SG_TRAJECTORIES`` through a durable pull consumer (explicit acks;
:mod:`consumers._runner`), decodes each trajectory (object-store pointers resolved), applies the
policies and grouping of :mod:`consumers.grouping` (a :class:`~consumers.grouping.GroupPlanner`)
and, once ``batch_size`` trajectories forming whole groups of ``group_size`` are ready (groups
taken in the order they completed; incomplete groups are held), writes a batch
(:mod:`consumers._batch_writer`):

1. the parquet (:mod:`consumers.parquet`) as object ``<batch_id>.parquet`` in ``sg_batches``;
2. a :class:`~consumers.parquet.BatchManifest` on ``sg.batches.ready`` (``Nats-Msg-Id`` = batch id);
3. optionally the same parquet as ``<output_dir>/<batch_id>.parquet`` (written, then renamed);

and only then acknowledges the member messages. ``batch_id`` is the sha256 of the sorted member
trajectory ids. Held messages get ``in_progress()`` every ``ack_wait_s / 3`` so JetStream does
not redeliver them while they wait. Each dropped trajectory is acknowledged and counted in
:meth:`Batcher.statistics`.

Exactly once, under ``kill -9`` at any point: acknowledging after publishing is not enough (the
redelivered members of a batch published just before a crash could form another batch), so the
choice of members is made durable before anything is published, as a
:class:`~consumers.batch_record.BatchRecord` in the KV bucket ``state_bucket``, and a delivery of
a trajectory already bound to a batch rebuilds or skips that batch. :mod:`consumers.batch_record`
tells the argument and its limits; it holds with **one batcher per durable consumer**.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import anyio
from anyio.abc import TaskStatus
from pipeline.connection import NatsAuth
from pipeline.events import PolicyUpdated, decode_event
from pipeline.subscriber import message_payload

from ._batch_writer import BatchWriter, open_state_bucket
from ._runner import DurableRunner, PullSpec
from .batch_record import BatchRecord
from .grouping import DroppedGroup, GroupingPolicy, GroupPlanner, check_batch_shape, prepare_trajectory
from .parquet import require_pyarrow
from .streams import ConsumerStreams
from .trajectory import Trajectory

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["Batcher", "BatcherConfig", "BatcherStatistics", "prepare_trajectory", "run_batcher"]

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """How trajectories become batches."""

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    auth: NatsAuth = field(default_factory=NatsAuth)  # credentials and TLS
    names: ConsumerStreams = field(default_factory=ConsumerStreams)
    durable: str = "batcher"
    batch_size: int = 16  # trajectories per batch
    group_size: int = 1  # a batch holds only whole groups of this size
    group_key: str = "metadata:group"  # or "prompt"
    max_staleness: int | None = None  # in policy versions; None: keep everything
    prompt_length: int = 1024
    response_length: int = 2048
    overlong: Literal["truncate", "drop"] = "truncate"
    no_reward: Literal["drop", "zero"] = "drop"
    output_dir: Path | None = None  # also write <batch_id>.parquet here
    ack_wait_s: float = 30.0
    max_pending: int = 4096  # trajectories held unacknowledged (the consumer's max_ack_pending)
    group_timeout_s: float | None = None  # drop a group still incomplete after this long
    state_bucket: str = "sg_batcher"  # the KV bucket of batch assignments
    fetch_batch: int = 256
    policy_poll_s: float = 2.0
    progress_interval_s: float = 10.0

    def __post_init__(self) -> None:
        check_batch_shape(self.batch_size, self.group_size)
        if self.max_pending < self.batch_size:
            raise ValueError(f"max_pending {self.max_pending} must be at least batch_size {self.batch_size}")
        _ = self.grouping  # checks the rest

    @property
    def grouping(self) -> GroupingPolicy:
        """The fields the grouping policy decides by."""
        return GroupingPolicy(
            batch_size=self.batch_size,
            group_size=self.group_size,
            group_key=self.group_key,
            max_staleness=self.max_staleness,
            prompt_length=self.prompt_length,
            response_length=self.response_length,
            overlong=self.overlong,
            no_reward=self.no_reward,
            group_timeout_s=self.group_timeout_s,
        )


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """Counters since start (messages, not distinct trajectories: a redelivery counts again)."""

    received: int
    dropped_stale: int
    dropped_length: int
    dropped_no_reward: int
    dropped_incomplete_group: int
    dropped_malformed: int
    undecodable: int
    truncated: int
    held: int  # messages held unacknowledged right now
    open_groups: int
    batches: int
    recovered_batches: int  # of which: batches assigned by a previous process, published now
    duplicates_skipped: int  # already in a published batch, or a second copy of a held one
    policy_version: int | None


# The counters a Batcher keeps itself; the rest of its statistics are read off its state.
_COUNTERS = tuple(f.name for f in fields(BatcherStatistics) if f.name not in ("held", "open_groups", "policy_version"))


@dataclass(slots=True)
class _Held:
    msg: Msg
    sequence: int  # stream sequence: a redelivery has the same, a republished copy another
    trajectory: Trajectory


@dataclass(slots=True)
class _Batch:
    """A batch being published: its durable record and whether it is a previous process's."""

    record: BatchRecord
    recovered: bool  # assigned (and committed) by a previous process

    @property
    def batch_id(self) -> str:
        return self.record.batch_id

    @property
    def members(self) -> tuple[str, ...]:
        return self.record.members


class Batcher:
    """One batcher; ``await run()`` until cancelled (``tg.start(batcher.run)`` waits until it consumes)."""

    def __init__(self, config: BatcherConfig, progress: Callable[[str], None] | None = None) -> None:
        self._config = config
        self._progress = progress
        self._planner = GroupPlanner(config.grouping)
        self._held: dict[str, _Held] = {}
        self._bound: dict[str, _Batch] = {}  # batch id -> an assigned batch waiting for its members
        self._bound_member: dict[str, str] = {}  # trajectory id -> batch id, for those
        self._pending_acks: list[Msg] = []
        self._counts = dict.fromkeys(_COUNTERS, 0)
        spec = PullSpec(
            stream=config.names.trajectories,
            subjects=config.names.trajectory_subjects,
            durable=config.durable,
            ack_wait_s=config.ack_wait_s,
            max_ack_pending=config.max_pending,
            fetch_timeout_s=_FETCH_TIMEOUT_S,
            sole_reader=True,  # one batcher per durable
            ride_out_disconnects=True,  # held messages survive a reconnect
        )
        self._runner = DurableRunner(
            spec, servers=config.servers, auth=config.auth, names=config.names, role="batcher", log=log
        )
        self._js: JetStreamContext | None = None
        self._writer: BatchWriter | None = None

    def statistics(self) -> BatcherStatistics:
        """A snapshot of the counters."""
        return BatcherStatistics(
            **self._counts,
            held=len(self._held),
            open_groups=self._planner.open_groups,
            policy_version=self._planner.current_version,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Consume and batch until cancelled."""
        require_pyarrow()
        config = self._config
        async with self._runner.connected() as (nc, js):
            kv = await open_state_bucket(js, config.state_bucket, config.names.replicas)
            subscription = await self._runner.bind(js)
            self._js = js
            self._writer = BatchWriter(nc, js, kv, names=config.names, output_dir=config.output_dir, log=log)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                tg.start_soon(self._policy_loop)
                if self._progress is not None:
                    tg.start_soon(self._progress_loop)
                task_status.started()
                await self._runner.consume(subscription, self._on_fetch, self._room)

    def _room(self) -> int:
        """How many messages the next fetch may bring: held ones count against ``max_pending``."""
        return max(1, min(self._config.fetch_batch, self._config.max_pending - len(self._held)))

    async def _on_fetch(self, messages: list[Msg]) -> None:
        import nats.errors

        for msg in messages:
            try:
                await self._receive(msg)
            except (nats.errors.Error, TimeoutError) as exc:  # neither held nor acked: redelivered later
                log.warning("batcher: message %s put aside (%r)", msg.metadata.sequence.stream, exc)
        await self._emit_ready()

    # -- receiving ---------------------------------------------------------------------------

    async def _receive(self, msg: Msg) -> None:
        from pydantic import ValidationError

        assert self._js is not None
        self._counts["received"] += 1
        try:
            trajectory = Trajectory.decode(await message_payload(msg, self._js))
        except (ValidationError, LookupError, ValueError) as exc:
            log.error("batcher: undecodable trajectory message %s: %s", msg.metadata.sequence.stream, exc)
            self._counts["undecodable"] += 1
            await msg.ack()
            return
        tid, sequence = trajectory.trajectory_id, msg.metadata.sequence.stream
        held = self._held.get(tid)
        if held is not None:
            if held.sequence == sequence:  # redelivered while held: answer the newest delivery
                held.msg = msg
            else:  # the same trajectory published twice: one copy is enough
                self._counts["duplicates_skipped"] += 1
                await msg.ack()
            return
        self._planner.note_trajectory(trajectory)
        batch = await self._binding(tid)
        if batch is not None:
            if batch.record.state == "published":
                self._counts["duplicates_skipped"] += 1
                await msg.ack()
                return
            self._hold_bound(batch, msg, sequence, trajectory)
            return
        self._admit(msg, sequence, trajectory)

    async def _binding(self, tid: str) -> _Batch | None:
        """The batch ``tid`` is bound to (see :mod:`consumers.batch_record`), if any."""
        assert self._writer is not None
        batch_id = self._bound_member.get(tid)
        if batch_id is not None:
            return self._bound[batch_id]
        record = await self._writer.binding(tid)
        return None if record is None else _Batch(record=record, recovered=True)

    def _hold_bound(self, batch: _Batch, msg: Msg, sequence: int, raw: Trajectory) -> None:
        record = batch.record
        if batch.batch_id not in self._bound:
            self._bound[batch.batch_id] = batch
            for member in batch.members:
                self._bound_member[member] = batch.batch_id
            log.info("batcher: batch %s was assigned before a restart; waiting for its members", batch.batch_id)
        prepared = prepare_trajectory(
            raw,
            prompt_length=record.prompt_length,
            response_length=record.response_length,
            overlong=record.overlong,
            no_reward=record.no_reward,
        )
        if isinstance(prepared, str):  # the policies are pure functions of the record: cannot happen
            raise RuntimeError(f"trajectory {raw.trajectory_id} of assigned batch {batch.batch_id} now {prepared}")
        self._held[raw.trajectory_id] = _Held(msg, sequence, prepared)

    def _admit(self, msg: Msg, sequence: int, raw: Trajectory) -> None:
        admission = self._planner.admit(raw)
        outcome = admission.outcome
        if isinstance(outcome, str):
            self._counts[f"dropped_{outcome}"] += 1
            self._ack_soon(msg)
        else:
            self._counts["truncated"] += outcome.truncated and not raw.truncated
            self._held[raw.trajectory_id] = _Held(msg, sequence, outcome)
        if admission.released is not None:
            self._release(admission.released)

    def _release(self, group: DroppedGroup) -> None:
        self._counts["dropped_incomplete_group"] += len(group.members)
        for tid in group.members:
            held = self._held.pop(tid, None)
            if held is not None:
                self._ack_soon(held.msg)

    def _ack_soon(self, msg: Msg) -> None:
        # Dropping happens in synchronous code; the acks go out before the next fetch.
        self._pending_acks.append(msg)

    # -- emitting ----------------------------------------------------------------------------

    async def _emit_ready(self) -> None:
        await self._flush_acks()
        for batch in [b for b in self._bound.values() if all(m in self._held for m in b.members)]:
            await self._emit(batch)
        while (plan := self._planner.next_batch()) is not None:
            record = BatchRecord.assign(plan, self._planner.policy, created_at=time.time())
            await self._emit(_Batch(record=record, recovered=False))

    async def _emit(self, batch: _Batch) -> None:
        """Commit (if new), publish, mark published (retrying NATS errors), then acknowledge."""
        import nats.errors

        assert self._writer is not None
        trajectories = [self._held[tid].trajectory for tid in batch.members]
        await self._writer.write(batch.record, trajectories, recovered=batch.recovered)
        self._bound.pop(batch.batch_id, None)
        acks = []
        for tid in batch.members:
            self._bound_member.pop(tid, None)
            held = self._held.pop(tid, None)
            if held is not None:
                acks.append(held.msg)
        for msg in acks:
            try:
                await msg.ack_sync(timeout=5)
            except (nats.errors.Error, TimeoutError) as exc:  # redelivered later, then skipped as published
                log.warning("batcher: ack of a member of %s failed: %r", batch.batch_id, exc)
        self._counts["batches"] += 1
        self._counts["recovered_batches"] += batch.recovered
        log.info("batcher: batch %s published (%d trajectories)", batch.batch_id, len(batch.members))

    async def _flush_acks(self) -> None:
        import nats.errors

        acks, self._pending_acks = self._pending_acks, []
        for msg in acks:
            try:
                await msg.ack()
            except nats.errors.Error as exc:  # redelivered, and decided again
                log.warning("batcher: ack of a dropped trajectory failed: %r", exc)

    # -- background --------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        import nats.errors

        interval = max(0.05, self._config.ack_wait_s / 3)
        while True:
            await anyio.sleep(interval)
            for group in self._planner.expire():
                log.info(
                    "batcher: group %s incomplete after %.0f s (%d held): dropped",
                    group.uid,
                    self._config.group_timeout_s,
                    len(group.members),
                )
                self._release(group)
            for held in list(self._held.values()):
                try:
                    await held.msg.in_progress()
                except nats.errors.Error as exc:  # disconnected: the redelivery is handled anyway
                    log.debug("batcher: in_progress failed: %r", exc)
                    break

    async def _policy_loop(self) -> None:
        import nats.errors

        assert self._js is not None
        names = self._config.names
        subject = f"{names.prefix}.events._._.policy.updated"
        while True:
            try:
                raw = await self._js.get_last_msg(names.events, subject)
                event = decode_event(raw.data or b"")
                if isinstance(event, PolicyUpdated):
                    self._planner.note_policy(event.policy_version)
            except (nats.errors.Error, ValueError) as exc:  # no events stream or no update yet
                log.debug("batcher: no policy.updated event: %r", exc)
            await anyio.sleep(self._config.policy_poll_s)

    async def _progress_loop(self) -> None:
        assert self._progress is not None
        while True:
            await anyio.sleep(self._config.progress_interval_s)
            s = self.statistics()
            line = (
                f"batcher: {s.received} received, {s.batches} batches, {s.held} held "
                f"({s.open_groups} open groups), dropped {s.dropped_stale} stale / {s.dropped_length} length / "
                f"{s.dropped_no_reward} no reward / {s.dropped_incomplete_group} in incomplete groups, "
                f"{s.truncated} truncated, {s.duplicates_skipped} duplicates skipped"
            )
            if s.held >= self._config.max_pending:
                line += " (max_pending reached: incomplete groups block the consumer; see group_timeout_s)"
            self._progress(line)


async def run_batcher(config: BatcherConfig, progress: Callable[[str], None] | None = None) -> None:
    """Run one batcher until cancelled."""
    await Batcher(config, progress).run()
