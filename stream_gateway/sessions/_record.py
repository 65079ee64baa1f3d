"""The session record replicas share in the sessions bucket (``s.<session>``), and its merge.

:class:`SessionRecord` and :class:`TurnEntry` are the typed form of the record's JSON; the JSON
keeps the short keys replicas have always written (``to_json``/``from_json`` are the only places
that know them), so a record written by any running replica still loads, and a record written
here is byte-for-byte what such a replica writes (``orjson.dumps``, keys in the same order).

:func:`merge_record` is a replica's write with the I/O taken out: what is stored (or nothing),
plus what this replica has pending, gives the record to compare-and-set. It is pure, so that two
replicas' writes to one session can be reasoned about (and tested) without NATS.

Deliberate choices:

* Values are kept as they were stored (no ``float()`` on read): rewriting a record must not change
  bytes it did not mean to change.
* Feedback records stay dicts: their shape is the HTTP API's (``POST /sessions/{id}/feedback``),
  not this module's; the record only needs their ``id`` to deduplicate them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipeline.events import tenant_id

from stream_gateway.sessions._store import SEQ_BLOCK, Session

__all__ = ["RECORD_VERSION", "SeqBlock", "SessionRecord", "TurnEntry", "merge_record"]

# The record's ``v``. 2: stored under its tenant's key (``s.<tenant>.<session>``, sessions/_shared.py);
# 1: under its id alone, read and migrated by its tenant.
RECORD_VERSION = 2

SeqBlock = tuple[int, int]  # [first, end) durable event numbers one replica reserved


@dataclass(frozen=True, slots=True)
class TurnEntry:
    """What the record holds of one turn; its token ids are in its event on the events stream."""

    parent_id: str | None  # "p"
    context_length: int  # "n": request messages that formed its prompt
    key: bytes | None  # "k" (hex): the conversation it closes; None: it cannot be continued
    seqs: tuple[int, ...]  # "q": the durable event numbers its events took
    finished: bool  # "f": it has a finish reason (it was not aborted)
    created_at: float  # "t": Unix seconds, to the millisecond

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON object, with the record's short keys."""
        return {
            "p": self.parent_id,
            "n": self.context_length,
            "k": self.key.hex() if self.key is not None else None,
            "q": list(self.seqs),
            "f": self.finished,
            "t": self.created_at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TurnEntry:
        """An entry from its JSON object (missing optional keys read as they always did)."""
        key = data.get("k")
        return cls(
            parent_id=data.get("p"),
            context_length=data.get("n", 0),
            key=bytes.fromhex(key) if key else None,
            seqs=tuple(data.get("q", ())),
            finished=data.get("f", False),
            created_at=data.get("t", 0.0),
        )


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A session as the replicas share it: who owns it, its lifetime, event numbers and turns."""

    session_id: str
    tenant: str  # the tenant's digest (``pipeline.events.tenant_id``), as its events carry it
    created_at: float
    last_active: float
    closed: str | None  # why it was closed; None: open
    next_seq: int  # the first durable event number no replica has reserved
    opened_seq: int | None  # the number of its ``session.opened``
    turns: Mapping[str, TurnEntry]  # by turn id, in the order they joined
    feedback: tuple[dict[str, Any], ...] = ()  # feedback records, each with an ``id``
    version: int = RECORD_VERSION

    def to_json(self) -> dict[str, Any]:
        """The record's JSON object: ``orjson.dumps`` of it is what is stored."""
        return {
            "v": self.version,
            "session_id": self.session_id,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "last_active": self.last_active,
            "closed": self.closed,
            "next_seq": self.next_seq,
            "opened_seq": self.opened_seq,
            "turns": {turn_id: entry.to_json() for turn_id, entry in self.turns.items()},
            "feedback": list(self.feedback),
        }

    @classmethod
    def new(cls, session: Session) -> SessionRecord:
        """The record of ``session`` before any replica stored it (its creator holds the first seq block)."""
        return cls(
            session_id=session.session_id,
            tenant=tenant_id(session.tenant),
            created_at=session.created_at,
            last_active=session.last_active,
            closed=None,
            next_seq=session.seq_end if session.seq_end else SEQ_BLOCK,
            opened_seq=session.opened_seq,
            turns={},
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SessionRecord:
        """A record from its JSON object, as any replica wrote it."""
        return cls(
            session_id=data["session_id"],
            tenant=data["tenant"],
            created_at=data["created_at"],
            last_active=data.get("last_active", 0),
            closed=data.get("closed"),
            next_seq=data["next_seq"],
            opened_seq=data.get("opened_seq"),
            turns={turn_id: TurnEntry.from_json(entry) for turn_id, entry in data["turns"].items()},
            feedback=tuple(data.get("feedback", ())),
            version=data.get("v", RECORD_VERSION),
        )


def merge_record(
    stored: SessionRecord | None,
    turns: Mapping[str, TurnEntry],
    feedback: Sequence[dict[str, Any]],
    close: str | None,
    last_active: float,
    reserve: bool,
    *,
    new: SessionRecord,
) -> tuple[SessionRecord, SeqBlock | None]:
    """The record once a replica's pending changes join ``stored``, and the seq block it reserved.

    ``new`` stands in for ``stored`` when there is none (a session no replica has stored yet).
    Turns are added (an entry for a turn already there replaces it: the writer knows it best);
    feedback joins unless its ``id`` is there; a close reason is kept once set; ``last_active``
    only grows; with ``reserve``, the next :data:`SEQ_BLOCK` event numbers are taken.
    """
    record = new if stored is None else stored
    have = {f["id"] for f in record.feedback}
    block: SeqBlock | None = None
    next_seq = record.next_seq
    if reserve:
        block = (next_seq, next_seq + SEQ_BLOCK)
        next_seq = block[1]
    merged = replace(
        record,
        turns={**record.turns, **turns},
        feedback=(*record.feedback, *(f for f in feedback if f["id"] not in have)),
        last_active=max(float(record.last_active), last_active),
        closed=close if close is not None and not record.closed else record.closed,
        next_seq=next_seq,
    )
    return merged, block
