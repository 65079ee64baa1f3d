"""The batcher's durable record of one batch: which trajectories it holds, decided before publishing.

Acknowledging a batch's members after publishing it is not enough for exactly once: a batcher
killed between publishing a batch and acknowledging its members gets them redelivered, and they
may form a *different* batch (other company, another id) whose manifest is not a duplicate to
JetStream: the same samples would be trained on twice. So the batcher makes its choice of members
durable before anything is published, in its JetStream KV bucket (``state_bucket``, file
storage, history 1)::

    t.<trajectory id>   -> batch id             (an index, written first)
    b.<batch id>        -> the batch record     (the commit point, written last)

A :class:`BatchRecord` holds the members and their uids in order, the policies applied (so a
recovered batch is rebuilt exactly as it was assigned, whatever the batcher's flags are now), the
creation time, the batches stream's last sequence before publishing, the LoRA adapter of its
members (every member's: batches never mix adapters), and ``state``: ``assigned``, later
``published``. A trajectory is *bound* to a batch iff its ``t.`` key names a batch whose
``b.`` record exists and lists it; an index entry without a record (a crash between the two
writes) binds nothing and is overwritten.

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

Deliberate choices:

* **The wire form is compact JSON with the fields in declaration order**, exactly the dict the
  batcher wrote before the record was typed: records already in a bucket read back, and a
  record written now reads in an older batcher.
* ``batches_last_seq`` is only known at the commit; a record that has none (never written so)
  leaves the key out rather than writing ``null``.
* ``adapter`` is left out for the base model (``null``), so a base model's record is byte for byte
  what it was before adapters, and a record without it (written before) is the base's. A
  record that has one names it last, after ``batches_last_seq``.
* Batchers serving different adapters (``--adapter``) may share one bucket: their batches have
  disjoint members, and a trajectory another batcher bound is never looked up by this one (it
  is not its adapter's). Sharing it means a batcher that replaces a batcher of every adapter
  skips what that one already published.
* ``batch_id`` is the sha256 of the sorted member ids (:func:`batch_id_of`): the same members
  make the same id, which JetStream deduplicates as the manifest's ``Nats-Msg-Id``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .grouping import GroupingPolicy, PlannedBatch

__all__ = ["BatchRecord", "batch_id_of"]


def batch_id_of(trajectory_ids: Iterable[str]) -> str:
    """The deterministic id of a batch: sha256 of its sorted member ids."""
    return hashlib.sha256("\n".join(sorted(trajectory_ids)).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """``b.<batch id>`` in the batcher's bucket (see the module docstring); field order is the wire's."""

    batch_id: str
    state: Literal["assigned", "published"]
    members: tuple[str, ...]  # trajectory ids, in row order
    uids: tuple[str, ...]  # each member's group uid in this batch
    group_size: int
    prompt_length: int
    response_length: int
    overlong: Literal["truncate", "drop"]
    no_reward: Literal["drop", "zero"]
    created_at: float  # Unix seconds, when the batch was first assembled
    unfinished: Literal["keep", "drop", "mask"] = "keep"  # records written before the policy: keep
    overlong_penalty: int | None = None  # DAPO's soft over-long punishment's cache length; None: none
    batches_last_seq: int | None = None  # the batches stream's last sequence at the commit
    adapter: str | None = None  # the LoRA adapter of every member; None: the base model

    @classmethod
    def assign(cls, plan: PlannedBatch, policy: GroupingPolicy, created_at: float) -> BatchRecord:
        """A new batch of ``plan``'s members under ``policy``, not yet committed."""
        return cls(
            batch_id=batch_id_of(plan.members),
            state="assigned",
            members=plan.members,
            uids=plan.uids,
            group_size=policy.group_size,
            prompt_length=policy.prompt_length,
            response_length=policy.response_length,
            overlong=policy.overlong,
            no_reward=policy.no_reward,
            created_at=created_at,
            adapter=plan.adapter,
            unfinished=policy.unfinished,
            overlong_penalty=policy.overlong_penalty,
        )

    def committed(self, batches_last_seq: int) -> BatchRecord:
        """The record as committed, noting where the batches stream stood."""
        return dataclasses.replace(self, batches_last_seq=batches_last_seq)

    def published(self) -> BatchRecord:
        """The record once its manifest is out."""
        return dataclasses.replace(self, state="published")

    def encode(self) -> bytes:
        """The wire form: compact JSON, fields in order, ``batches_last_seq`` left out while unknown,
        ``adapter`` for the base model and ``unfinished`` when it is ``keep``."""
        data = dataclasses.asdict(self)
        for key in ("batches_last_seq", "adapter"):
            if data[key] is None:
                del data[key]
        if data["unfinished"] == "keep":  # the default: left out, as before the policy existed
            del data["unfinished"]
        if data["overlong_penalty"] is None:
            del data["overlong_penalty"]
        return orjson.dumps(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchRecord:
        """A record from its decoded JSON (a ``KeyError`` if a field is missing)."""
        return cls(
            batch_id=data["batch_id"],
            state=data["state"],
            members=tuple(data["members"]),
            uids=tuple(data["uids"]),
            group_size=data["group_size"],
            prompt_length=data["prompt_length"],
            response_length=data["response_length"],
            overlong=data["overlong"],
            no_reward=data["no_reward"],
            created_at=data["created_at"],
            batches_last_seq=data.get("batches_last_seq"),
            adapter=data.get("adapter"),
            unfinished=data.get("unfinished", "keep"),
            overlong_penalty=data.get("overlong_penalty"),
        )

    @classmethod
    def decode(cls, data: bytes) -> BatchRecord:
        """Parse the wire form."""
        return cls.from_dict(orjson.loads(data))
