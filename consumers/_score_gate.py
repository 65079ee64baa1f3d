"""The batcher's side of scores: ``--reward FORMULA`` and ``--await-scorer NAME:SECONDS``.

The reward worker records each scorer's verdict on each trajectory in ``sg_scores``
(:mod:`consumers.reward_worker`); :class:`ScoreGate` turns those records into rewards, with the
formula's rules (:func:`consumers.scores.apply_scores`), at three moments:

* **On receipt** every trajectory gets the formula over the scores recorded so far (one lookup per
  scorer the formula names).
* **Awaited scorers.** A trajectory missing the record of an awaited scorer is held aside,
  unacknowledged and in no group yet, until each awaited scorer has a record (a score, a timeout
  or an error) or its bound has passed since the trajectory was *published* (the message's
  JetStream time, so a batcher restarted meanwhile does not wait longer). It is then admitted with
  what it has: a formula still missing a term leaves it ``unscored``, with the assembler's reward.
  ``stream-gateway pending`` says how many wait, for which scorers, and for how long at most.
* **Scores that come later** are read through a durable consumer of the batcher's own on the
  bucket's stream (``<consumer>-scores``, acknowledged once handled, so none is missed across
  restarts): a held trajectory is given them in place (a revision before its batch: ``revised``);
  one already in a published batch is read back from the trajectories stream, given them, and
  recorded on that batch as a late reward (``l.<batch id>.<trajectory>`` in the batcher's bucket,
  as late feedback is: ``late_rewards``). A trajectory dropped before its scores came (no reward,
  under ``--no-reward drop``) is not taken back: await its scorers instead.

It keeps nothing that is not in NATS: what it holds aside is unacknowledged and comes back after a
crash; the records are in the bucket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
from pipeline.connection import NatsAuth
from pipeline.events import subject_token
from pipeline.subscriber import message_payload
from pydantic import ValidationError

from ._runner import DurableRunner, PullSpec
from .scores import RewardFormula, ScoreRecord, apply_scores, score_key
from .streams import ConsumerStreams
from .trajectory import Trajectory

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

    from ._batch_writer import BatchWriter

__all__ = ["ScoreGate", "Scored", "Waiting"]

log = logging.getLogger("consumers.batcher")

_FEED_BATCH = 256
_FEED_WAIT_S = 0.5
_ARRIVED_MAX = 1024  # records fetched but not yet handled by the batcher: the feed pauses there


@dataclass(frozen=True, slots=True)
class Scored:
    """A trajectory with the formula applied, and the scorers that had a record of it."""

    trajectory: Trajectory
    found: frozenset[str]


@dataclass(slots=True)
class Waiting:
    """A trajectory held aside for awaited scores."""

    msg: Msg
    sequence: int
    trajectory: Trajectory
    published_at: float
    missing: set[str]


class ScoreGate:
    """Scores into rewards for one batcher (module docstring); its state is touched by the batcher's
    consuming task only, but for :meth:`follow`, which only appends what it fetched."""

    def __init__(
        self,
        formula: RewardFormula,
        awaited: Mapping[str, float],
        names: ConsumerStreams,
        feed: DurableRunner,
        ack_soon: Callable[[Msg], None],
    ) -> None:
        self.formula = formula
        self._awaited = dict(awaited)
        self._names = names
        self._feed = feed
        self._ack_soon = ack_soon
        self._waiting: dict[str, Waiting] = {}
        self._arrived: list[Msg] = []
        self._taken: list[Msg] = []
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None
        self._subscription: Any = None
        self.expired = 0  # trajectories admitted after their bound with an awaited scorer still missing

    @classmethod
    def of(
        cls,
        formula: RewardFormula,
        awaited: Mapping[str, float],
        *,
        names: ConsumerStreams,
        consumer: str,
        servers: tuple[str, ...],
        auth: NatsAuth,
        ack_wait_s: float,
        ack_soon: Callable[[Msg], None],
    ) -> ScoreGate:
        """The gate of a batcher reading through ``consumer`` (its scores' consumer: ``<consumer>-scores``)."""
        spec = PullSpec(
            stream=f"KV_{names.score_bucket}",
            subjects=f"$KV.{names.score_bucket}.>",
            durable=f"{consumer}-scores",
            ack_wait_s=ack_wait_s,
            max_ack_pending=_ARRIVED_MAX * 2,
            fetch_timeout_s=_FEED_WAIT_S,
            sole_reader=True,  # one batcher per consumer, so one per scores' consumer
            ride_out_disconnects=True,
        )
        feed = DurableRunner(spec, servers=servers, auth=auth, names=names, role="batcher-scores", log=log)
        return cls(formula, awaited, names, feed, ack_soon)

    async def open(self, js: JetStreamContext) -> None:
        """Bind the bucket and the durable consumer of its stream (provisioned with the consumers' streams)."""
        self._js = js
        self._kv = await js.key_value(self._names.score_bucket)
        self._subscription = await self._feed.bind(js)

    async def follow(self) -> NoReturn:
        """Fetch the bucket's new records for the batcher to take (:meth:`take_arrived`), for ever."""
        while True:
            if len(self._arrived) >= _ARRIVED_MAX:
                await anyio.sleep(_FEED_WAIT_S)
                continue
            fetched = await self._feed.fetch(self._subscription, _FEED_BATCH, _FEED_WAIT_S)
            self._arrived.extend(fetched)  # the list of now: take_arrived may have swapped it during the fetch

    async def apply(self, trajectory: Trajectory) -> Scored:
        """``trajectory`` with the formula over its recorded scores."""
        from nats.js.errors import KeyNotFoundError

        assert self._kv is not None
        records: dict[str, ScoreRecord] = {}
        for name in sorted(self.formula.scorers | self._awaited.keys()):
            key = score_key(trajectory.tenant, trajectory.session_id, trajectory.trajectory_id, name)
            try:
                records[name] = ScoreRecord.decode((await self._kv.get(key)).value or b"")
            except KeyNotFoundError:
                continue
            except (ValidationError, ValueError) as exc:  # not a record this batcher reads: as if none
                log.warning("batcher: unreadable score %s: %s", key, exc)
        return Scored(apply_scores(trajectory, records, self.formula), frozenset(records))

    def holding(self, trajectory_id: str) -> bool:
        """Whether the trajectory is held aside, waiting for scores."""
        return trajectory_id in self._waiting

    def hold(self, msg: Msg, sequence: int, scored: Scored) -> bool:
        """Hold the trajectory aside if it waits for an awaited scorer (or is held already: a
        redelivery or a revision of it replaces it); ``False``: admit it now."""
        trajectory = scored.trajectory
        missing = set(self._awaited) - scored.found
        waiting = self._waiting.get(trajectory.trajectory_id)
        if waiting is not None:
            if sequence == waiting.sequence:  # redelivered while held: answer the newest delivery
                waiting.msg = msg
            elif trajectory.revision > waiting.trajectory.revision:  # a late reward while it waits
                self._ack_soon(waiting.msg)
                waiting.msg, waiting.sequence = msg, sequence
            else:  # a second copy
                self._ack_soon(msg)
                return True
            waiting.trajectory, waiting.missing = trajectory, missing & waiting.missing
            return True
        published = msg.metadata.timestamp.timestamp()
        if all(time.time() >= published + self._awaited[name] for name in missing):
            self.expired += bool(missing)
            return False
        self._waiting[trajectory.trajectory_id] = Waiting(msg, sequence, trajectory, published, missing)
        return True

    def take_arrived(self) -> list[ScoreRecord]:
        """The records fetched since the last call that the formula uses (their messages are
        acknowledged by :meth:`acknowledge_taken`); the trajectories waiting for them are told."""
        taken, self._arrived = self._arrived, []
        self._taken = taken  # not those of a call whose handling failed: they come again after ack_wait
        records = []
        for msg in taken:
            if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):  # erased: nothing to give
                continue
            try:
                record = ScoreRecord.decode(msg.data)
            except (ValidationError, ValueError) as exc:
                log.warning("batcher: unreadable score on %s: %s", msg.subject, exc)
                continue
            waiting = self._waiting.get(record.trajectory_id)
            if waiting is not None:
                waiting.missing.discard(record.scorer)
            if record.scorer in self.formula.scorers:
                records.append(record)
        return records

    async def released(self) -> list[Waiting]:
        """The trajectories whose wait is over (every awaited record there, or the bounds passed),
        given every score recorded so far; no longer held aside."""
        now, out = time.time(), []
        for tid, waiting in list(self._waiting.items()):
            if all(now >= waiting.published_at + self._awaited[name] for name in waiting.missing):
                del self._waiting[tid]
                self.expired += bool(waiting.missing)
                waiting.trajectory = (await self.apply(waiting.trajectory)).trajectory
                out.append(waiting)
        return out

    async def acknowledge_taken(self) -> None:
        """Acknowledge the records taken: handled, they are not needed again."""
        import nats.errors

        taken, self._taken = self._taken, []
        for msg in taken:
            try:
                await msg.ack()
            except nats.errors.Error as exc:  # delivered again, and handled again: the same outcome
                log.debug("batcher: ack of a score failed: %r", exc)

    def messages(self) -> list[Msg]:
        """The messages held aside (the batcher's heartbeat keeps them from redelivery)."""
        return [waiting.msg for waiting in self._waiting.values()]

    def drop(self, gone: Callable[[Trajectory], bool]) -> int:
        """Stop holding (and acknowledge) the trajectories ``gone`` says were forgotten; how many."""
        dropped = [tid for tid, waiting in self._waiting.items() if gone(waiting.trajectory)]
        for tid in dropped:
            self._ack_soon(self._waiting.pop(tid).msg)
        return len(dropped)

    def summary(self) -> dict[str, Any]:
        """For ``stream-gateway pending``: how many wait, for which scorers, and for how long at most."""
        now = time.time()
        scorers: dict[str, int] = {}
        due = 0.0
        for waiting in self._waiting.values():
            for name in waiting.missing:
                scorers[name] = scorers.get(name, 0) + 1
                due = max(due, waiting.published_at + self._awaited[name] - now)
        return {"trajectories": len(self._waiting), "scorers": dict(sorted(scorers.items())),
                "due_in_s": round(max(0.0, due), 1), "reward": self.formula.text}  # fmt: skip

    async def record_late(self, writer: BatchWriter, batch_id: str, record: ScoreRecord) -> bool:
        """A score for a trajectory in the published batch ``batch_id``: the trajectory read back, given
        the formula, and recorded on the batch as a late reward if the scores changed its rewards."""
        newest = await self._newest_copy(record)
        if newest is None:
            return False
        scored = (await self.apply(newest)).trajectory
        changed = scored.reward_source == self.formula.text or [t.reward for t in scored.turns] != [
            t.reward for t in newest.turns
        ]
        if changed:
            await writer.record_late_reward(batch_id, scored)
        return changed

    async def _newest_copy(self, record: ScoreRecord) -> Trajectory | None:
        """The newest revision of ``record``'s trajectory on the trajectories stream (``None``: gone)."""
        from nats.js.errors import NotFoundError

        assert self._js is not None
        names = self._names
        subject = f"{names.prefix}.trajectories.{subject_token(record.tenant)}.{subject_token(record.session_id)}"
        sequence, newest = 0, None
        while True:  # a session's trajectories and their revisions: a few messages
            try:
                raw = await self._js.get_msg(names.trajectories, sequence + 1, subject=subject, next=True)
            except NotFoundError:
                return newest
            sequence = int(raw.seq or sequence + 1)
            try:
                copy = Trajectory.decode(await message_payload(raw, self._js))  # type: ignore[arg-type]
            except (ValidationError, LookupError, ValueError):
                continue
            if copy.trajectory_id == record.trajectory_id and (newest is None or copy.revision >= newest.revision):
                newest = copy
