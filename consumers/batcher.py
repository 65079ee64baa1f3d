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

LoRA adapters: a batch never mixes them (:mod:`consumers.grouping`: groups, batches and
staleness are per adapter, and the manifest names the batch's adapter). With ``only_adapter``
(or ``only_base``: the base model; ``--adapter``/``--base`` on the command line) the batcher takes
one adapter's trajectories, for a trainer of that adapter. It reads through a durable consumer
of its own, ``<durable>-adapter-<name>`` (``<durable>-base``), so that batchers of different
adapters each receive every trajectory: each acknowledges the other adapters' at once,
untouched (``other_adapter`` in :meth:`Batcher.statistics`), on its own consumer only, before
looking up any batch binding. They may share ``state_bucket``: their batches' members are
disjoint.

Images: a vision-language trajectory's images are checked before it is admitted, without being
processed (:meth:`consumers.images.ImageStore.check`: every object in ``sg_images``, the stored
digest the image's name, the processor rebuilt here, the row's runs its placeholder). One that
fails (an object missing, another image under the name) is dropped with its reason logged and
counted (``dropped_images``), never batched; its group is released like any group with a dropped
member. The trainer processes each image once, from the same bucket, and compares the pixels with
the digest recorded while sampling (:mod:`consumers.verl_adapter`): the parquet carries
references, not pixels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from anyio.abc import TaskStatus
from pipeline.connection import NatsAuth
from pipeline.events import PolicyUpdated, decode_event
from pipeline.policies import adapter_subject, policy_subject
from pipeline.subscriber import message_payload
from pipeline.tombstones import Tombstones

from consumers.errors import ImagesRefused

from ._batch_writer import BatchWriter, open_state_bucket
from ._runner import DurableRunner, PullSpec
from ._score_gate import ScoreGate
from .batch_record import BatchRecord
from .grouping import (
    AdapterFilter,
    Drop,
    DroppedGroup,
    GroupingPolicy,
    GroupPlanner,
    adapter_filter,
    prepare_trajectory,
)
from .images import ImageStore
from .parquet import require_pyarrow
from .scores import RewardFormula
from .streams import ConsumerStreams
from .trajectory import UNFINISHED, Trajectory, erased

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["Batcher", "BatcherConfig", "BatcherStatistics", "prepare_trajectory", "run_batcher"]

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 0.5
_RESTART_S = 1.0  # between a run a NATS error ended and the next


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """How trajectories become batches."""

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    auth: NatsAuth = field(default_factory=NatsAuth)  # credentials and TLS
    names: ConsumerStreams = field(default_factory=ConsumerStreams)
    durable: str = "batcher"  # with an adapter filter, the consumer is named after it too (consumer_name)
    only_adapter: str | None = None  # take only this LoRA adapter's trajectories
    only_base: bool = False  # take only the base model's trajectories
    # batch and group sizes, the group key, staleness, lengths and the policies for over-long and
    # unrewarded trajectories: the planner's own settings (flat, as the CLI's flags: BatcherConfig.of)
    grouping: GroupingPolicy = field(default_factory=GroupingPolicy)
    output_dir: Path | None = None  # also write <batch_id>.parquet here
    parquet_max_age_s: float = 0.0  # delete this batcher's parquet files older than this (retention); 0: never
    ack_wait_s: float = 30.0
    max_pending: int = 4096  # trajectories held unacknowledged (the consumer's max_ack_pending)
    state_bucket: str = "sg_batcher"  # the KV bucket of batch assignments
    fetch_batch: int = 256
    policy_poll_s: float = 2.0
    progress_interval_s: float = 10.0
    # Scores (consumers._score_gate): the reward formula over the reward worker's scorers (--reward),
    # and how long a trajectory waits for each of the awaited ones after it was published (--await-scorer).
    reward: str | None = None
    await_scorers: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_pending < self.grouping.batch_size:
            raise ValueError(f"max_pending {self.max_pending} must be at least batch_size {self.grouping.batch_size}")
        _ = self.adapters  # checks the adapter filter
        formula = self.formula
        awaited = {name for name, _ in self.await_scorers}
        if awaited and (formula is None or not awaited <= formula.scorers):
            raise ValueError(f"--await-scorer {', '.join(sorted(awaited))}: await only scorers --reward names")

    @property
    def formula(self) -> RewardFormula | None:
        """``reward`` parsed (``ValueError`` if it does not parse); ``None``: scores are not used."""
        return None if self.reward is None else RewardFormula.parse(self.reward)

    @classmethod
    def of(cls, **values: Any) -> BatcherConfig:
        """A config from flat values, as the command line has them: :class:`GroupingPolicy`'s
        fields (``batch_size``, ``group_size``, ...) go into ``grouping``, the rest are this class's."""
        policy = {name.name for name in fields(GroupingPolicy)}
        grouping = GroupingPolicy(**{k: v for k, v in values.items() if k in policy})
        return cls(grouping=grouping, **{k: v for k, v in values.items() if k not in policy})

    @property
    def adapters(self) -> AdapterFilter | None:
        """The one adapter this batcher takes (``only_adapter``/``only_base``); ``None``: every adapter."""
        return adapter_filter(self.only_adapter, self.only_base)

    @property
    def consumer_name(self) -> str:
        """The durable consumer read: ``durable``, or with an adapter filter ``<durable>-adapter-<name>``/``-base``."""
        adapters = self.adapters
        return self.durable if adapters is None else adapters.consumer_name(self.durable)


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
    policy_version: int | None  # of the adapter taken (only_adapter/only_base), else of the base model
    other_adapter: int = 0  # trajectories of an adapter this batcher does not take, acknowledged untouched
    dropped_images: int = 0  # images missing from sg_images, another image under the name, or placeholders that differ
    dropped_erased: int = 0  # of a session or tenant forgotten (stream-gateway forget), with their groups
    dropped_unfinished: int = 0  # an unfinished last turn, under --unfinished drop
    masked_unfinished: int = 0  # an unfinished last turn taken out of the loss, under --unfinished mask
    revised: int = 0  # held trajectories replaced by a late-reward revision before their batch
    late_rewards: int = 0  # late-reward revisions of trajectories already in a published batch (recorded on it)
    awaiting_scores: int = 0  # held aside now, waiting for awaited scorers (--await-scorer)
    score_waits_expired: int = 0  # admitted after the bound with an awaited scorer still missing
    end_reasons: dict[str, int] = field(default_factory=dict)  # received trajectories per end reason
    adapter_versions: dict[str | None, int] = field(default_factory=dict)  # newest known per adapter (None: base)


# The counters a Batcher keeps itself; the rest of its statistics are read off its state.
_STATE = ("held", "open_groups", "policy_version", "adapter_versions", "end_reasons", "awaiting_scores",
          "score_waits_expired")  # fmt: skip
_COUNTERS = tuple(f.name for f in fields(BatcherStatistics) if f.name not in _STATE)


@dataclass(slots=True)
class _Held:
    msg: Msg
    sequence: int  # stream sequence: a redelivery has the same, a republished copy another
    trajectory: Trajectory  # as it goes into the batch
    raw: Trajectory  # as received (with its scores): what a later score is applied to


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
        self._adapters = config.adapters
        self._planner = GroupPlanner(config.grouping)
        self._held: dict[str, _Held] = {}
        self._bound: dict[str, _Batch] = {}  # batch id -> an assigned batch waiting for its members
        self._bound_member: dict[str, str] = {}  # trajectory id -> batch id, for those
        self._pending_acks: list[Msg] = []
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._end_reasons: dict[str, int] = {}
        self._drops: list[tuple[str, str]] = []  # (trajectory id, why) not yet in the bucket
        spec = PullSpec(
            stream=config.names.trajectories,
            subjects=config.names.trajectory_subjects,
            durable=config.consumer_name,
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
        self._tombstones = Tombstones(config.names.prefix, replicas=config.names.replicas)
        self._tombstones.on_forgotten = self._forgotten
        self._images: ImageStore | None = None
        self._flushes: list[Msg] = []  # flush requests (``stream-gateway flush``), answered after the next fetch
        formula = config.formula
        self._scores = None if formula is None else ScoreGate.of(
            formula, dict(config.await_scorers), names=config.names, consumer=config.consumer_name,
            servers=config.servers, auth=config.auth, ack_wait_s=config.ack_wait_s, ack_soon=self._ack_soon,
        )  # fmt: skip

    def statistics(self) -> BatcherStatistics:
        """A snapshot of the counters."""
        adapter = None if self._adapters is None else self._adapters.adapter
        return BatcherStatistics(
            **self._counts,
            held=len(self._held),
            open_groups=self._planner.open_groups,
            policy_version=self._planner.version_of(adapter),
            adapter_versions=self._planner.versions(),
            end_reasons=dict(self._end_reasons),
            awaiting_scores=0 if self._scores is None else len(self._scores.messages()),
            score_waits_expired=0 if self._scores is None else self._scores.expired,
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
            self._images = ImageStore(js, config.names.image_bucket)  # checks only: nothing processed, nothing cached
            self._writer = BatchWriter(nc, js, kv, names=config.names, output_dir=config.output_dir, log=log)
            await self._tombstones.load(js)
            if self._scores is not None:
                await self._scores.open(js)
            flushes = await nc.subscribe(config.names.flush_subject, cb=self._on_flush_request)
            pending = await nc.subscribe(config.names.pending_subject, cb=self._on_pending)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._tombstones.follow, js)
                tg.start_soon(self._heartbeat_loop)
                tg.start_soon(self._policy_loop)
                if self._scores is not None:
                    tg.start_soon(self._scores.follow)
                if config.output_dir is not None and config.parquet_max_age_s:
                    tg.start_soon(self._retention_loop, config.output_dir, config.parquet_max_age_s)
                if self._progress is not None:
                    tg.start_soon(self._progress_loop)
                task_status.started()
                try:
                    await self._runner.consume(subscription, self._on_fetch, self._room)
                finally:
                    with anyio.CancelScope(shield=True):
                        await flushes.unsubscribe()
                        await pending.unsubscribe()

    async def _retention_loop(self, directory: Path, max_age_s: float) -> None:
        """Delete the batch files in ``directory`` older than ``max_age_s``, now and then (an hour at most
        between looks, a tenth of the age when that is shorter)."""
        while True:
            removed = await anyio.to_thread.run_sync(remove_old_batch_files, directory, max_age_s)
            if removed:
                log.info("batcher: %d parquet files older than %g s removed from %s (retention)",
                         removed, max_age_s, directory)  # fmt: skip
            await anyio.sleep(min(3600.0, max(1.0, max_age_s / 10)))

    def _room(self) -> int:
        """How many messages the next fetch may bring: held ones (and those awaiting scores) count against
        ``max_pending``."""
        held = len(self._held) + (0 if self._scores is None else len(self._scores.messages()))
        return max(1, min(self._config.fetch_batch, self._config.max_pending - held))

    async def _on_fetch(self, messages: list[Msg]) -> None:
        import nats.errors

        for msg in messages:
            try:
                await self._receive(msg)
            except (nats.errors.Error, TimeoutError) as exc:  # neither held nor acked: redelivered later
                log.warning("batcher: message %s put aside (%r)", msg.metadata.sequence.stream, exc)
        if self._scores is not None:
            try:
                await self._take_scores(self._scores)
            except (nats.errors.Error, TimeoutError) as exc:  # the scores not acknowledged come again
                log.warning("batcher: scores put aside (%r)", exc)
        flushes, self._flushes = self._flushes, []
        before = self._counts["batches"]
        await self._emit_ready(partial=bool(flushes))
        if flushes:  # the answer: what was emitted, and what still waits (groups not yet whole)
            answer = orjson.dumps({"batches": self._counts["batches"] - before, "held": len(self._held),
                                   "open_groups": self._planner.open_groups})  # fmt: skip
            for request in flushes:
                if request.reply:
                    await request.respond(answer)

    async def _on_pending(self, msg: Msg) -> None:
        """``stream-gateway pending``: what this batcher holds and what a batch still needs (read only)."""
        s = self.statistics()
        policy = self._config.grouping
        answer = {"role": "batcher", "held": s.held, "open_groups": s.open_groups, "batch_size": policy.batch_size,
                  "group_size": policy.group_size, "batches": s.batches}  # fmt: skip
        if self._scores is not None:
            answer["scores"] = self._scores.summary()
        if msg.reply:
            await msg.respond(orjson.dumps(answer))

    async def _on_flush_request(self, msg: Msg) -> None:
        """Kept for the consuming task (the only one that touches what is held), which answers it."""
        self._flushes.append(msg)

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
        if erased(self._tombstones, trajectory.tenant, trajectory.session_id):
            self._counts["dropped_erased"] += 1
            self._ack_soon(msg)
            return
        if self._adapters is not None and not self._adapters.takes(trajectory.adapter):
            # Another adapter's: its own batcher has its own consumer. Before any binding lookup,
            # as a batch of that adapter in a shared bucket is not this batcher's to rebuild.
            self._counts["other_adapter"] += 1
            self._ack_soon(msg)
            return
        tid, sequence = trajectory.trajectory_id, msg.metadata.sequence.stream
        gate, scored = self._scores, None
        if gate is not None:  # the --reward formula over the scores recorded so far
            scored = await gate.apply(trajectory)
            trajectory = scored.trajectory
            if gate.holding(tid):  # held aside for scores: this copy replaces that one
                gate.hold(msg, sequence, scored)
                return
        held = self._held.get(tid)
        if held is not None:
            if held.sequence == sequence:  # redelivered while held: answer the newest delivery
                held.msg = msg
            elif trajectory.revision > held.trajectory.revision:  # a late reward before its batch: use it
                self._revise(held, msg, sequence, trajectory)
            else:  # the same trajectory published twice: one copy is enough
                self._counts["duplicates_skipped"] += 1
                await msg.ack()
            return
        self._planner.note_trajectory(trajectory)
        batch = await self._binding(tid)
        if batch is not None:
            if batch.record.state == "published":
                if trajectory.revision > 0:  # a late reward after its batch: recorded on that batch
                    assert self._writer is not None
                    await self._writer.record_late_reward(batch.record.batch_id, trajectory)
                    self._counts["late_rewards"] += 1
                    log.info("batcher: late reward for %s (revision %d) recorded on batch %s",
                             tid, trajectory.revision, batch.record.batch_id)  # fmt: skip
                else:
                    self._counts["duplicates_skipped"] += 1
                await msg.ack()
                return
            self._hold_bound(batch, msg, sequence, trajectory)
            return
        if gate is not None and scored is not None and gate.hold(msg, sequence, scored):
            return  # waits for an awaited scorer (--await-scorer)
        self._admit(msg, sequence, trajectory, await self._check_images(trajectory))

    async def _check_images(self, trajectory: Trajectory) -> Drop | None:
        """``"images"`` if the trajectory's images cannot be trained on (logged); ``None``: fine, or none."""
        if not trajectory.images:
            return None
        assert self._images is not None
        try:
            await self._images.check(trajectory)
        except ImagesRefused as exc:
            log.error("batcher: %s dropped, its images cannot be trained on: %s", exc.trajectory_id, exc.reason)
            return "images"
        return None

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
            unfinished=record.unfinished,
            overlong_penalty=record.overlong_penalty,
        )
        if isinstance(prepared, str):  # the policies are pure functions of the record: cannot happen
            raise RuntimeError(f"trajectory {raw.trajectory_id} of assigned batch {batch.batch_id} now {prepared}")
        self._held[raw.trajectory_id] = _Held(msg, sequence, prepared, raw)

    def _revise(self, held: _Held, msg: Msg, sequence: int, trajectory: Trajectory) -> None:
        """A held trajectory's late-reward revision replaces it (same id, same group): a revision
        published by the assembler, or (``msg`` the held one's) the held one given a score that came."""
        policy = self._planner.policy
        prepared = prepare_trajectory(
            trajectory, prompt_length=policy.prompt_length, response_length=policy.response_length,
            overlong=policy.overlong, no_reward=policy.no_reward, unfinished=policy.unfinished,
            overlong_penalty=policy.overlong_penalty,
        )  # fmt: skip
        if isinstance(prepared, str):  # a revision only adds rewards: what was admitted stays admissible
            log.warning("batcher: revision %d of %s now %s; the held copy stays", trajectory.revision,
                        trajectory.trajectory_id, prepared)  # fmt: skip
            if msg is not held.msg:
                self._ack_soon(msg)
            return
        if msg is not held.msg:
            self._ack_soon(held.msg)
        held.msg, held.sequence, held.trajectory, held.raw = msg, sequence, prepared, trajectory
        self._counts["revised"] += 1

    def _admit(self, msg: Msg, sequence: int, raw: Trajectory, refused: Drop | None = None) -> None:
        reason = raw.end_reason or "unknown"
        self._end_reasons[reason] = self._end_reasons.get(reason, 0) + 1
        admission = self._planner.admit(raw, refused)
        outcome = admission.outcome
        if isinstance(outcome, str):
            self._counts[f"dropped_{outcome}"] += 1
            self._drops.append((raw.trajectory_id, outcome))
            self._ack_soon(msg)
        else:
            self._counts["truncated"] += outcome.truncated and not raw.truncated
            self._counts["masked_unfinished"] += (
                self._planner.policy.unfinished == "mask" and raw.end_reason in UNFINISHED and bool(raw.turns)
            )
            self._held[raw.trajectory_id] = _Held(msg, sequence, outcome, raw)
        if admission.released is not None:
            self._release(admission.released)

    def _release(self, group: DroppedGroup) -> None:
        self._counts["dropped_incomplete_group"] += len(group.members)
        self._drops.extend((tid, "incomplete_group") for tid in group.members if tid in self._held)
        for tid in group.members:
            held = self._held.pop(tid, None)
            if held is not None:
                self._ack_soon(held.msg)

    async def _take_scores(self, gate: ScoreGate) -> None:
        """Scores that came since the last fetch (``consumers._score_gate``), then the trajectories whose
        wait for scores is over."""
        for record in gate.take_arrived():
            tid = record.trajectory_id
            if (held := self._held.get(tid)) is not None:  # before its batch: held with it (a revision)
                self._revise(held, held.msg, held.sequence, (await gate.apply(held.raw)).trajectory)
            elif gate.holding(tid) or self._writer is None or (batch := await self._binding(tid)) is None:
                continue  # waiting (released below), or not here yet: its scores are looked up on receipt
            elif batch.record.state == "published":  # after its batch: a late reward on that batch
                self._counts["late_rewards"] += await gate.record_late(self._writer, batch.batch_id, record)
        for waited in await gate.released():
            self._admit(waited.msg, waited.sequence, waited.trajectory, await self._check_images(waited.trajectory))
        await gate.acknowledge_taken()

    def _ack_soon(self, msg: Msg) -> None:
        # Dropping happens in synchronous code; the acks go out before the next fetch.
        self._pending_acks.append(msg)

    # -- emitting ----------------------------------------------------------------------------

    def _forgotten(self, key: str) -> None:
        """A tombstone: the held trajectories of the sessions it names go, with their groups."""
        gone = {
            tid for tid, held in self._held.items()
            if erased(self._tombstones, held.trajectory.tenant, held.trajectory.session_id)
            and tid not in self._bound_member  # a batch assigned before a restart is the forget's to rewrite
        }  # fmt: skip
        if self._scores is not None:
            self._counts["dropped_erased"] += self._scores.drop(
                lambda t: erased(self._tombstones, t.tenant, t.session_id)
            )
        for group in self._planner.drop(gone):
            self._counts["dropped_erased"] += len(group.members)
            for tid in group.members:
                held = self._held.pop(tid, None)
                if held is not None:
                    self._ack_soon(held.msg)

    async def _emit_ready(self, partial: bool = False) -> None:
        """Emit the batches that are complete (``partial``: every whole group held, in batches that
        may be smaller than ``batch_size``: a flush on demand)."""
        import nats.errors

        assert self._js is not None
        try:
            await self._tombstones.current(self._js)  # nothing of a session forgotten a moment ago
        except (nats.errors.Error, TimeoutError) as exc:  # NATS away: no batch until it answers again
            log.debug("batcher: tombstones not checked (%r); batches wait", exc)
            return
        await self._flush_acks()
        for batch in [b for b in self._bound.values() if all(m in self._held for m in b.members)]:
            await self._emit(batch)
        while (plan := self._planner.next_batch(partial)) is not None:
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
        log.info(
            "batcher: batch %s published (%d trajectories%s)",
            batch.batch_id,
            len(batch.members),
            "" if batch.record.adapter is None else f", adapter {batch.record.adapter!r}",
        )

    async def _flush_acks(self) -> None:
        import nats.errors

        acks, self._pending_acks = self._pending_acks, []
        drops, self._drops = self._drops, []
        if drops and self._writer is not None:
            try:  # why each was left out, for the console (before the ack: a crash decides it again)
                await self._writer.record_drops(drops)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("batcher: %d drop reasons not recorded: %r", len(drops), exc)
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
                    "batcher: group %s%s incomplete after %.0f s (%d held): dropped",
                    group.uid,
                    "" if group.adapter is None else f" (adapter {group.adapter!r})",
                    self._config.grouping.group_timeout_s,
                    len(group.members),
                )
                self._release(group)
            aside = [] if self._scores is None else self._scores.messages()
            for msg in [*(held.msg for held in self._held.values()), *aside]:
                try:
                    await msg.in_progress()
                except nats.errors.Error as exc:  # disconnected: the redelivery is handled anyway
                    log.debug("batcher: in_progress failed: %r", exc)
                    break

    async def _policy_loop(self) -> None:
        """Note the newest ``policy.updated`` of the base model and of every LoRA adapter.

        The base's are on :func:`~pipeline.policies.policy_subject` (its latest is read at each
        poll); the adapters' on :func:`~pipeline.policies.adapter_subject`, every adapter's on that
        one subject, so each poll reads those after the last one it noted, one by one.
        """
        import nats.errors

        assert self._js is not None
        names = self._config.names
        base_subject = policy_subject(names.prefix)
        noted = 0  # the adapters' events are noted up to this stream sequence
        while True:
            try:
                raw = await self._js.get_last_msg(names.events, base_subject)
                event = decode_event(raw.data or b"")
                if isinstance(event, PolicyUpdated) and event.adapter is None:
                    self._planner.note_policy(event.policy_version)
            except (nats.errors.Error, ValueError) as exc:  # no events stream or no update yet
                log.debug("batcher: no policy.updated event: %r", exc)
            try:
                noted = await self._note_adapter_policies(noted)
            except nats.errors.Error as exc:  # no events stream or no adapter update yet
                log.debug("batcher: no adapter's policy.updated event: %r", exc)
            await anyio.sleep(self._config.policy_poll_s)

    async def _note_adapter_policies(self, noted: int) -> int:
        """Note the adapters' ``policy.updated`` events after stream sequence ``noted``; the last one noted."""
        assert self._js is not None
        stream, subject = self._config.names.events, adapter_subject(self._config.names.prefix)
        last = int((await self._js.get_last_msg(stream, subject)).seq or 0)
        while noted < last:
            raw = await self._js.get_msg(stream, noted + 1, subject=subject, next=True)
            try:
                event = decode_event(raw.data or b"")
            except ValueError as exc:  # not an event this batcher can read: the others still count
                log.warning("batcher: unreadable policy event %s on %s: %s", raw.seq, subject, exc)
            else:
                if isinstance(event, PolicyUpdated) and event.adapter is not None:
                    self._planner.note_policy(event.policy_version, event.adapter)
            noted = max(int(raw.seq or 0), noted + 1)
        return noted

    async def _progress_loop(self) -> None:
        assert self._progress is not None
        last = ""
        while True:
            await anyio.sleep(self._config.progress_interval_s)
            s = self.statistics()
            line = (
                f"batcher: {s.received} received, {s.batches} batches, {s.held} held "
                f"({s.open_groups} open groups), dropped {s.dropped_stale} stale / {s.dropped_length} length / "
                f"{s.dropped_no_reward} no reward / {s.dropped_images} images / "
                f"{s.dropped_incomplete_group} in incomplete groups, "
                f"{s.truncated} truncated, {s.duplicates_skipped} duplicates skipped"
            )
            if self._adapters is not None:
                line += f", {s.other_adapter} of other adapters skipped (only {self._adapters})"
            if s.held >= self._config.max_pending:
                line += " (max_pending reached: incomplete groups block the consumer; see group_timeout_s)"
            if line != last:  # only what changed: an idle batcher buried the request log (issue 43)
                last = line
                self._progress(line)


def remove_old_batch_files(directory: Path, max_age_s: float) -> int:
    """Delete ``<batch id>.parquet`` files in ``directory`` last written more than ``max_age_s`` ago;
    returns how many. Other files are left alone."""
    cutoff = time.time() - max_age_s
    removed = 0
    for path in directory.glob("*.parquet"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # removed by someone else meanwhile
            continue
    return removed


async def run_batcher(config: BatcherConfig, progress: Callable[[str], None] | None = None) -> None:
    """Run one batcher until cancelled.

    A NATS error that ends a run (provisioning or writing while a cluster elects a leader: seen
    in the cluster chaos run, where the batcher died at the first leader kill and wrote nothing
    more) starts a fresh batcher a second later, as a restarted process would: what the old one
    held unacknowledged is delivered again, and its batches' state is in the bucket.
    """
    import nats.errors

    while True:
        try:
            await Batcher(config, progress).run()
        except* (nats.errors.Error, TimeoutError, ConnectionResetError) as group:  # a refusal: exit
            log.warning("batcher: NATS failed (%r); starting again in %.0f s", group.exceptions[0], _RESTART_S)
        await anyio.sleep(_RESTART_S)
