"""The batcher: trajectories in, verl training batches out, each trajectory in exactly one batch.

One batcher reads ``SG_TRAJECTORIES`` through a durable pull consumer (explicit acks), decodes
each trajectory (object-store pointers resolved), applies the policies below, groups the
survivors by :func:`~consumers.verl_batch.group_uid` and, once ``batch_size`` trajectories
forming whole groups of ``group_size`` are ready (groups taken in the order they completed;
incomplete groups are held), writes a batch:

1. the parquet (:mod:`consumers.parquet`) as object ``<batch_id>.parquet`` in ``sg_batches``;
2. a :class:`~consumers.parquet.BatchManifest` on ``sg.batches.ready`` (``Nats-Msg-Id`` = batch id);
3. optionally the same parquet as ``<output_dir>/<batch_id>.parquet`` (written, then renamed);

and only then acknowledges the member messages. ``batch_id`` is the sha256 of the sorted member
trajectory ids. Held messages get ``in_progress()`` every ``ack_wait_s / 3`` so JetStream does
not redeliver them while they wait.

Policies (each dropped trajectory is acknowledged and counted in :meth:`Batcher.statistics`):

* **staleness**: dropped when ``min_policy_version < current - max_staleness``, ``current`` being
  the highest of the latest ``policy.updated`` event on the events stream (polled) and the
  highest ``max_policy_version`` seen in a trajectory;
* **length**: a prompt over ``prompt_length`` is dropped; a response over ``response_length`` is
  cut there (``overlong="truncate"``: ids, mask and logprobs cut, turns clipped, marked
  ``truncated``) or dropped (``"drop"``); an empty prompt or response is dropped (verl needs both);
* **malformed**: ids, mask and logprobs of different lengths, a mask value other than 0/1, or a
  sampled id inside the first prompt (which verl's layout would lose): dropped, so that a batch
  never fails to build in the trainer;
* **reward**: a trajectory without one is dropped (``no_reward="drop"``) or gets 0.0 (``"zero"``).

A group with a dropped member can never be whole: when its members plus its dropped count reach
``group_size`` the rest are dropped too (``dropped_incomplete_group``). A trajectory whose group
key is ``metadata:<name>`` but whose session has no such metadata is grouped by its prompt. More
than ``group_size`` trajectories with one key (a session that branched) make further groups of
the same key; two of them in one batch get distinct uids (``<uid>.1``, ...). With
``group_timeout_s`` an incomplete group held that long is dropped (without it, it waits forever
and occupies ``max_pending`` slots).

Exactly once, under ``kill -9`` at any point
--------------------------------------------

Acknowledging after publishing is not enough: a batcher killed between publishing a batch and
acknowledging its members gets them redelivered, and they may form a *different* batch (other
company, another id) whose manifest is not a duplicate to JetStream: the same samples would be
trained on twice. So the choice of members is made durable before anything is published, in the
JetStream KV bucket ``state_bucket``::

    t.<trajectory id>   -> batch id             (an index, written first)
    b.<batch id>        -> the batch record     (the commit point, written last)

The record holds the members and their uids in order, the policies applied, the creation time,
the stream's last sequence before publishing, and ``state`` (``assigned``, later ``published``).
A trajectory is *bound* to a batch iff its ``t.`` key names a batch whose ``b.`` record exists;
an index entry without a record (a crash between the two writes) binds nothing and is overwritten.

On every delivery the batcher looks the trajectory up: bound to a ``published`` batch, it is
acknowledged and skipped; bound to an ``assigned`` one, it is held until every member of that
batch is back (they are: none was ever acknowledged), then exactly that batch is rebuilt from
the record (same members, uids and policies; staleness is not asked again) and published. The
manifest's publication is idempotent twice over: JetStream drops a repeated ``Nats-Msg-Id``
within the stream's duplicate window, and a recovered batch first looks for its own manifest
among the messages published after the sequence its record noted, so a recovery after the window
does not publish it again either. The object is only rewritten while no manifest points at it.
After publishing, the record becomes ``published`` and then the members are acknowledged; a lost
acknowledgement is harmless (the redelivery is skipped).

So, with one batcher per durable consumer (a batch needs one view of the groups; a second
instance running *at the same time* would split groups and can race on the index), every
trajectory that survives the policies is in exactly one published manifest, crashes or not
(of the batcher or of NATS: a redelivery after a lost acknowledgement is skipped), and none is
lost while its message stays in the stream. A drop is acknowledged at once; should that
acknowledgement be lost, the redelivered trajectory is decided anew (``current`` may have
moved), which is still at most once.

Limits, deliberately: an assigned batch waits for all its members, so one whose message was
removed from the stream (retention) holds the others; the count of a group's dropped members
lives in memory, so after a restart such a group waits for members that will not come (use
``group_timeout_s``); a recovered batch looks for its own manifest among at most the last
10,000 messages of the batches stream.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import orjson
from anyio.abc import TaskStatus

from pipeline.connection import NatsAuth, connect
from pipeline.durable import publish_durable
from pipeline.events import PolicyUpdated, decode_event, subject_token
from pipeline.subscriber import message_payload

from .parquet import BatchManifest, encode_batch, require_pyarrow
from .streams import ConsumerStreams, ensure_consumer_streams
from .trajectory import Trajectory

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["Batcher", "BatcherConfig", "BatcherStatistics", "prepare_trajectory", "run_batcher"]

log = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 0.5
_OBJECT_TIMEOUT_S = 60.0
_RETRY_MAX_S = 10.0
_MANIFEST_SCAN_LIMIT = 10_000

Drop = Literal["stale", "length", "no_reward", "malformed"]


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
        if self.batch_size < 1 or self.group_size < 1 or self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size {self.batch_size} must be a positive multiple of group_size {self.group_size}"
            )
        if self.max_pending < self.batch_size:
            raise ValueError(f"max_pending {self.max_pending} must be at least batch_size {self.batch_size}")
        if self.group_key != "prompt" and not (self.group_key.startswith("metadata:") and len(self.group_key) > 9):
            raise ValueError(f"group_key {self.group_key!r}: expected 'prompt' or 'metadata:<name>'")
        if self.prompt_length < 1 or self.response_length < 1:
            raise ValueError("prompt_length and response_length must be positive")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")


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


def prepare_trajectory(
    trajectory: Trajectory,
    *,
    prompt_length: int,
    response_length: int,
    overlong: Literal["truncate", "drop"],
    no_reward: Literal["drop", "zero"],
) -> Trajectory | Drop:
    """The trajectory as it goes into a batch (cut, reward defaulted), or why it is dropped.

    Staleness is not decided here: it depends on the batcher's view of the current policy.
    """
    ids, mask = trajectory.token_ids, trajectory.loss_mask
    if (
        len(ids) != len(mask)
        or len(ids) != len(trajectory.logprobs)
        or any(m not in (0, 1) for m in mask)
        or any(mask[: trajectory.prompt_length])
    ):
        return "malformed"
    if not 0 < trajectory.prompt_length <= prompt_length or trajectory.response_length <= 0:
        return "length"
    if trajectory.reward is None:
        if no_reward == "drop":
            return "no_reward"
        trajectory = trajectory.model_copy(update={"reward": 0.0, "reward_source": "default"})
    if trajectory.response_length > response_length:
        if overlong == "drop":
            return "length"
        cut = trajectory.prompt_length + response_length
        turns = [
            turn.model_copy(update={"length": min(turn.length, cut - turn.start)})
            for turn in trajectory.turns
            if turn.start < cut
        ]
        trajectory = trajectory.model_copy(
            update={
                "token_ids": trajectory.token_ids[:cut],
                "loss_mask": trajectory.loss_mask[:cut],
                "logprobs": trajectory.logprobs[:cut],
                "turns": turns,
                "num_turns": max(1, len(turns)) if trajectory.turns else trajectory.num_turns,
                "truncated": True,
            }
        )
    return trajectory


def batch_id_of(trajectory_ids: list[str]) -> str:
    """The deterministic id of a batch: sha256 of its sorted member ids."""
    return hashlib.sha256("\n".join(sorted(trajectory_ids)).encode()).hexdigest()


def _group_uid(trajectory: Trajectory, key: str) -> str:
    from .verl_batch import group_uid

    if key.startswith("metadata:") and key.removeprefix("metadata:") not in trajectory.metadata:
        key = "prompt"
    return group_uid(trajectory, key)


@dataclass(slots=True)
class _Held:
    msg: Msg
    sequence: int  # stream sequence: a redelivery has the same, a republished copy another
    trajectory: Trajectory


@dataclass(slots=True)
class _OpenGroup:
    uid: str
    members: list[str] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)  # a set: a second copy of a dropped one counts once
    since: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Batch:
    """A batch being published: its durable record and the held members."""

    record: dict[str, Any]
    recovered: bool
    committed: bool = False

    @property
    def batch_id(self) -> str:
        return str(self.record["batch_id"])

    @property
    def members(self) -> list[str]:
        return list(self.record["members"])


class Batcher:
    """One batcher; ``await run()`` until cancelled (``tg.start(batcher.run)`` waits until it consumes)."""

    def __init__(self, config: BatcherConfig, progress: Callable[[str], None] | None = None) -> None:
        self._config = config
        self._progress = progress
        self._held: dict[str, _Held] = {}
        self._open: dict[str, _OpenGroup] = {}  # group uid -> its current (incomplete) instance
        self._ready: deque[tuple[str, list[str]]] = deque()  # whole groups, in completion order
        self._bound: dict[str, _Batch] = {}  # batch id -> an assigned batch waiting for its members
        self._bound_member: dict[str, str] = {}  # trajectory id -> batch id, for those
        self._pending_acks: list[Msg] = []
        self._policy_version: int | None = None
        self._seen_version: int | None = None
        self._counts = dict.fromkeys(
            (
                "received",
                "dropped_stale",
                "dropped_length",
                "dropped_no_reward",
                "dropped_incomplete_group",
                "dropped_malformed",
                "undecodable",
                "truncated",
                "batches",
                "recovered_batches",
                "duplicates_skipped",
            ),
            0,
        )
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None

    def statistics(self) -> BatcherStatistics:
        """A snapshot of the counters."""
        return BatcherStatistics(
            **self._counts,
            held=len(self._held),
            open_groups=len(self._open),
            policy_version=self._current_version(),
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Consume and batch until cancelled."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
        from nats.js.errors import BucketNotFoundError, NotFoundError

        require_pyarrow()
        config, names = self._config, self._config.names
        # A server that is not up yet is waited for; one that refuses us ends the run (NatsRefused).
        nc = await connect(config.servers, config.auth, name=f"batcher-{config.durable}", max_reconnect_attempts=-1)
        try:
            js = nc.jetstream()
            await ensure_consumer_streams(js, names)
            try:
                kv = await js.key_value(config.state_bucket)
            except (BucketNotFoundError, NotFoundError):
                kv_config = KeyValueConfig(
                    bucket=config.state_bucket, storage=StorageType.FILE, replicas=names.replicas, history=1
                )
                kv = await js.create_key_value(config=kv_config)
            await js.add_consumer(
                names.trajectories,
                ConsumerConfig(
                    durable_name=config.durable,
                    filter_subject=names.trajectory_subjects,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    ack_wait=config.ack_wait_s,
                    max_ack_pending=config.max_pending,
                    max_deliver=-1,
                ),
            )
            subscription = await js.pull_subscribe_bind(config.durable, stream=names.trajectories)
            self._nc, self._js, self._kv = nc, js, kv
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                tg.start_soon(self._policy_loop)
                if self._progress is not None:
                    tg.start_soon(self._progress_loop)
                task_status.started()
                await self._consume_loop(subscription)
        finally:
            with anyio.move_on_after(2, shield=True):
                await nc.close()

    async def _consume_loop(self, subscription: Any) -> None:
        import nats.errors

        while True:
            room = max(1, min(self._config.fetch_batch, self._config.max_pending - len(self._held)))
            try:
                messages = await subscription.fetch(room, timeout=_FETCH_TIMEOUT_S)
            except TimeoutError:  # nats-py raises its own subclass or a plain one, depending on the path
                messages = []
            except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError) as exc:
                log.warning("batcher: fetch failed (%r); retrying", exc)
                await anyio.sleep(1)
                continue
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
        self._note_version(trajectory.max_policy_version)
        batch = await self._binding(tid)
        if batch is not None:
            if batch.record["state"] == "published":
                self._counts["duplicates_skipped"] += 1
                await msg.ack()
                return
            self._hold_bound(batch, msg, sequence, trajectory)
            return
        self._admit(msg, sequence, trajectory)

    async def _binding(self, tid: str) -> _Batch | None:
        """The batch ``tid`` is bound to (see the module docstring), if any."""
        from nats.js.errors import KeyNotFoundError

        assert self._kv is not None
        batch_id = self._bound_member.get(tid)
        if batch_id is not None:
            return self._bound[batch_id]
        try:
            entry = await self._kv.get(f"t.{subject_token(tid)}")
            batch_id = (entry.value or b"").decode()
            record_entry = await self._kv.get(f"b.{batch_id}")
        except KeyNotFoundError:
            return None
        record = orjson.loads(record_entry.value or b"{}")
        if tid not in record.get("members", ()):
            return None
        return _Batch(record=record, recovered=True, committed=True)

    def _hold_bound(self, batch: _Batch, msg: Msg, sequence: int, raw: Trajectory) -> None:
        record = batch.record
        if batch.batch_id not in self._bound:
            self._bound[batch.batch_id] = batch
            for member in batch.members:
                self._bound_member[member] = batch.batch_id
            log.info("batcher: batch %s was assigned before a restart; waiting for its members", batch.batch_id)
        prepared = prepare_trajectory(
            raw,
            prompt_length=record["prompt_length"],
            response_length=record["response_length"],
            overlong=record["overlong"],
            no_reward=record["no_reward"],
        )
        if isinstance(prepared, str):  # the policies are pure functions of the record: cannot happen
            raise RuntimeError(f"trajectory {raw.trajectory_id} of assigned batch {batch.batch_id} now {prepared}")
        self._held[raw.trajectory_id] = _Held(msg, sequence, prepared)

    def _admit(self, msg: Msg, sequence: int, raw: Trajectory) -> None:
        config = self._config
        prepared: Trajectory | Drop
        current = self._current_version()
        if config.max_staleness is not None and current is not None:
            stale = raw.min_policy_version < current - config.max_staleness
        else:
            stale = False
        if stale:
            prepared = "stale"
        else:
            prepared = prepare_trajectory(
                raw,
                prompt_length=config.prompt_length,
                response_length=config.response_length,
                overlong=config.overlong,
                no_reward=config.no_reward,
            )
        uid = _group_uid(raw, config.group_key)
        group = self._open.get(uid)
        if group is None:
            group = self._open[uid] = _OpenGroup(uid)
        if isinstance(prepared, str):
            self._counts[f"dropped_{prepared}"] += 1
            self._ack_soon(msg)
            group.dropped.add(raw.trajectory_id)
        else:
            self._counts["truncated"] += prepared.truncated and not raw.truncated
            self._held[raw.trajectory_id] = _Held(msg, sequence, prepared)
            group.members.append(raw.trajectory_id)
        if len(group.members) + len(group.dropped) >= config.group_size:
            del self._open[uid]
            if group.dropped:
                self._drop_group(group)
            else:
                self._ready.append((uid, group.members))

    def _drop_group(self, group: _OpenGroup) -> None:
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
        config = self._config
        for batch in [b for b in self._bound.values() if all(m in self._held for m in b.members)]:
            await self._emit(batch)
        while sum(len(members) for _, members in self._ready) >= config.batch_size:
            uids: list[str] = []
            members: list[str] = []
            occurrences: dict[str, int] = {}
            while len(members) < config.batch_size:
                uid, group = self._ready.popleft()
                seen = occurrences.get(uid, 0)
                occurrences[uid] = seen + 1
                uids += [uid if not seen else f"{uid}.{seen}"] * len(group)
                members += group
            batch_id = batch_id_of(members)
            record = {
                "batch_id": batch_id,
                "state": "assigned",
                "members": members,
                "uids": uids,
                "group_size": config.group_size,
                "prompt_length": config.prompt_length,
                "response_length": config.response_length,
                "overlong": config.overlong,
                "no_reward": config.no_reward,
                "created_at": time.time(),
            }
            await self._emit(_Batch(record=record, recovered=False))

    async def _emit(self, batch: _Batch) -> None:
        """Commit (if new), publish, mark published, acknowledge; NATS errors are retried."""
        import nats.errors

        delay = 0.5
        attempt = 0
        while True:
            try:
                if not batch.committed:
                    await self._commit(batch)
                    batch.committed = True
                await self._publish(batch, look_for_manifest=batch.recovered or attempt > 0)
                break
            except (nats.errors.Error, TimeoutError) as exc:
                attempt += 1
                log.warning("batcher: writing batch %s failed (%r); retrying in %.1f s", batch.batch_id, exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
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

    async def _commit(self, batch: _Batch) -> None:
        assert self._kv is not None and self._js is not None
        info = await self._js.stream_info(self._config.names.batches)
        batch.record["batches_last_seq"] = info.state.last_seq
        for tid in batch.members:  # the index first, the record (the commit point) last
            await self._kv.put(f"t.{subject_token(tid)}", batch.batch_id.encode())
        await self._kv.put(f"b.{batch.batch_id}", orjson.dumps(batch.record))

    async def _publish(self, batch: _Batch, *, look_for_manifest: bool) -> None:
        assert self._nc is not None and self._js is not None and self._kv is not None
        config, names, record = self._config, self._config.names, batch.record
        trajectories = [self._held[tid].trajectory for tid in batch.members]
        data = encode_batch(
            trajectories,
            list(record["uids"]),
            batch_id=batch.batch_id,
            prompt_length=record["prompt_length"],
            response_length=record["response_length"],
        )
        object_name = f"{batch.batch_id}.parquet"
        if look_for_manifest and await self._manifest_published(batch):
            log.info("batcher: batch %s was announced before a restart; not announcing it again", batch.batch_id)
        else:
            with anyio.fail_after(_OBJECT_TIMEOUT_S):
                store = await self._js.object_store(names.batch_bucket)
                await store.put(object_name, data)
            manifest = BatchManifest(
                batch_id=batch.batch_id,
                bucket=names.batch_bucket,
                object=object_name,
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                group_size=record["group_size"],
                groups=list(dict.fromkeys(record["uids"])),
                trajectory_ids=batch.members,
                min_policy_version=min(t.min_policy_version for t in trajectories),
                max_policy_version=max(t.max_policy_version for t in trajectories),
                prompt_length=record["prompt_length"],
                response_length=record["response_length"],
                created_at=record["created_at"],
            )
            await publish_durable(
                self._nc, self._js, names.batch_subject, batch.batch_id, manifest.encode(), bucket=names.payload_bucket
            )
        if config.output_dir is not None:
            await anyio.to_thread.run_sync(_write_atomically, config.output_dir / object_name, data)
        await self._kv.put(f"b.{batch.batch_id}", orjson.dumps(record | {"state": "published"}))

    async def _manifest_published(self, batch: _Batch) -> bool:
        """Whether a manifest with this batch's id is on the stream after the record's sequence."""
        from nats.js.errors import NotFoundError

        assert self._js is not None
        stream = self._config.names.batches
        last = (await self._js.stream_info(stream)).state.last_seq
        first = int(batch.record.get("batches_last_seq", 0)) + 1
        for seq in range(max(first, last - _MANIFEST_SCAN_LIMIT), last + 1):
            try:
                raw = await self._js.get_msg(stream, seq)
            except NotFoundError:
                continue
            if (raw.headers or {}).get("Nats-Msg-Id") == batch.batch_id:
                return True
        return False

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
            self._expire_groups()
            for held in list(self._held.values()):
                try:
                    await held.msg.in_progress()
                except nats.errors.Error as exc:  # disconnected: the redelivery is handled anyway
                    log.debug("batcher: in_progress failed: %r", exc)
                    break

    def _expire_groups(self) -> None:
        timeout = self._config.group_timeout_s
        if timeout is None:
            return
        cutoff = time.monotonic() - timeout
        for uid in [uid for uid, group in self._open.items() if group.since < cutoff]:
            group = self._open.pop(uid)
            log.info("batcher: group %s incomplete after %.0f s (%d held): dropped", uid, timeout, len(group.members))
            self._drop_group(group)

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
                    self._policy_version = max(self._policy_version or 0, event.policy_version)
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

    def _note_version(self, version: int) -> None:
        self._seen_version = version if self._seen_version is None else max(self._seen_version, version)

    def _current_version(self) -> int | None:
        known = [v for v in (self._policy_version, self._seen_version) if v is not None]
        return max(known) if known else None


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


async def run_batcher(config: BatcherConfig, progress: Callable[[str], None] | None = None) -> None:
    """Run one batcher until cancelled."""
    await Batcher(config, progress).run()
