"""The shared session record (``stream_gateway.sessions._record``) and a turn's event form.

No NATS: the record's JSON, its merge and the turn/event conversion are pure. The JSON must stay
what replicas already running write (the short keys, in their order), so records are compared as
``orjson.dumps`` bytes against dicts of that shape, and the merge against the dict merge the
record replaced (``_legacy_merge``, kept here as the oracle).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import orjson
import pytest

from pipeline.events import SamplingRecord, TurnAborted, TurnCompleted
from stream_gateway.sessions import (
    SEQ_BLOCK,
    Session,
    SessionRecord,
    Turn,
    TurnEntry,
    TurnSignal,
    merge_record,
    turn_from_event,
    turn_to_event,
)
from stream_gateway.tool_parsers import ToolCall


def _stored_dict(**changes: Any) -> dict[str, Any]:
    """A record as a running replica stores it (the dict its ``_write`` dumped)."""
    record: dict[str, Any] = {
        "v": 1,
        "session_id": "s1",
        "tenant": "t0123456789abcdef",
        "created_at": 1700000000.25,
        "last_active": 1700000100.5,
        "closed": None,
        "next_seq": 8192,
        "opened_seq": 0,
        "turns": {
            "a": {"p": None, "n": 1, "k": "00ff10", "q": [1, 2], "f": True, "t": 1700000001.123},
            "b": {"p": "a", "n": 3, "k": None, "q": [4097, 4098], "f": False, "t": 1700000002.5},
        },
        "feedback": [{"id": "fb1", "object": "session.feedback", "session_id": "s1", "turn_id": "a", "seq": 3}],
    }
    record.update(changes)
    return record


def _legacy_merge(
    stored: dict[str, Any] | None,
    new: dict[str, Any],
    turns: dict[str, dict[str, Any]],
    feedback: list[dict[str, Any]],
    close: str | None,
    last_active: float,
    reserve: bool,
) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The merge ``SharedSessions._write`` did on dicts before the record was typed."""
    if stored is None:
        record = {**new, "turns": dict(new["turns"]), "feedback": list(new["feedback"])}
    else:
        record = {**stored, "turns": dict(stored["turns"]), "feedback": list(stored["feedback"])}
    record["turns"].update(turns)
    have = {f["id"] for f in record["feedback"]}
    record["feedback"].extend(f for f in feedback if f["id"] not in have)
    record["last_active"] = max(float(record.get("last_active", 0)), last_active)
    if close is not None and not record.get("closed"):
        record["closed"] = close
    block = None
    if reserve:
        block = (record["next_seq"], record["next_seq"] + SEQ_BLOCK)
        record["next_seq"] = block[1]
    return record, block


def _entry(parent: str | None, *, seqs: tuple[int, ...] = (), key: bytes | None = None) -> TurnEntry:
    return TurnEntry(parent_id=parent, context_length=2, key=key, seqs=seqs, finished=True, created_at=1700000003.001)


def _session(seq_end: int | None = None) -> Session:
    session = Session("s1", "sk-key", 1700000000.25, 1700000000.25)
    session.seq_end = seq_end
    session.opened_seq = 0
    return session


def test_a_stored_record_round_trips_byte_for_byte() -> None:
    for stored in (_stored_dict(), _stored_dict(closed="client", opened_seq=None, feedback=[], turns={})):
        raw = orjson.dumps(stored)
        record = SessionRecord.from_json(orjson.loads(raw))
        assert orjson.dumps(record.to_json()) == raw
    record = SessionRecord.from_json(_stored_dict())
    assert record.turns["a"] == TurnEntry(
        parent_id=None, context_length=1, key=b"\x00\xff\x10", seqs=(1, 2), finished=True, created_at=1700000001.123
    )
    assert record.turns["b"].key is None and record.turns["b"].parent_id == "a"
    assert record.closed is None and record.next_seq == 8192 and record.feedback[0]["id"] == "fb1"


def test_a_turn_entry_missing_optional_keys_reads_as_before() -> None:
    entry = TurnEntry.from_json({"p": "a", "q": [7], "f": True, "t": 1.0})
    assert entry.key is None and entry.context_length == 0 and entry.seqs == (7,)


def test_a_new_record_is_what_a_creating_replica_wrote() -> None:
    session = _session()
    expected = {
        "v": 2,  # stored under its tenant (sessions/_shared.py record_key)
        "session_id": "s1",
        "tenant": SessionRecord.new(session).tenant,
        "created_at": session.created_at,
        "last_active": session.last_active,
        "closed": None,
        "next_seq": SEQ_BLOCK,
        "opened_seq": 0,
        "turns": {},
        "feedback": [],
    }
    assert orjson.dumps(SessionRecord.new(session).to_json()) == orjson.dumps(expected)
    assert SessionRecord.new(_session(seq_end=3 * SEQ_BLOCK)).next_seq == 3 * SEQ_BLOCK


def test_turns_written_by_two_replicas_both_land_as_siblings() -> None:
    new = SessionRecord.new(_session(seq_end=SEQ_BLOCK))
    root, _ = merge_record(None, {"r": _entry(None, seqs=(1, 2))}, [], None, 10.0, False, new=new)
    # Both replicas continue the root from the same stored revision; the second to write
    # loses the compare-and-set, reads the first one's record and merges again.
    first, _ = merge_record(root, {"x": _entry("r", seqs=(3, 4))}, [], None, 11.0, False, new=new)
    second, _ = merge_record(first, {"y": _entry("r", seqs=(4097, 4098))}, [], None, 12.0, False, new=new)
    assert list(second.turns) == ["r", "x", "y"]
    assert second.turns["x"].parent_id == second.turns["y"].parent_id == "r"
    assert list(root.turns) == ["r"] and list(first.turns) == ["r", "x"]  # merging changed no input


def test_a_rewritten_turn_entry_replaces_the_stored_one_in_place() -> None:
    stored = SessionRecord.from_json(_stored_dict())
    entry = _entry(None, seqs=(1, 2, 9))
    merged, _ = merge_record(stored, {"a": entry}, [], None, 0.0, False, new=stored)
    assert list(merged.turns) == ["a", "b"] and merged.turns["a"] == entry


def test_feedback_is_deduplicated_by_id() -> None:
    stored = SessionRecord.from_json(_stored_dict())
    again = {"id": "fb1", "object": "session.feedback", "score": 9.0}
    fresh = {"id": "fb2", "object": "session.feedback", "score": 1.0}
    merged, _ = merge_record(stored, {}, [again, fresh], None, 0.0, False, new=stored)
    assert [f["id"] for f in merged.feedback] == ["fb1", "fb2"]
    assert merged.feedback[0] == stored.feedback[0]  # the stored one is kept, not the repeat


def test_a_close_is_kept_once_set() -> None:
    stored = SessionRecord.from_json(_stored_dict())
    closed, _ = merge_record(stored, {}, [], "client", 0.0, False, new=stored)
    assert closed.closed == "client"
    again, _ = merge_record(closed, {}, [], "idle", 0.0, False, new=stored)
    assert again.closed == "client"
    still, _ = merge_record(closed, {"z": _entry("a")}, [], None, 0.0, False, new=stored)
    assert still.closed == "client"


def test_a_seq_block_is_reserved_from_next_seq() -> None:
    stored = SessionRecord.from_json(_stored_dict())
    merged, block = merge_record(stored, {}, [], None, 0.0, True, new=stored)
    assert block == (8192, 8192 + SEQ_BLOCK) and merged.next_seq == 8192 + SEQ_BLOCK
    again, second = merge_record(merged, {}, [], None, 0.0, True, new=stored)
    assert second == (8192 + SEQ_BLOCK, 8192 + 2 * SEQ_BLOCK) and again.next_seq == second[1]
    kept, none = merge_record(merged, {}, [], None, 0.0, False, new=stored)
    assert none is None and kept.next_seq == merged.next_seq
    created, first = merge_record(None, {}, [], None, 0.0, True, new=SessionRecord.new(_session()))
    assert first == (SEQ_BLOCK, 2 * SEQ_BLOCK) and created.next_seq == 2 * SEQ_BLOCK  # the creator holds [0, SEQ_BLOCK)


def test_last_active_only_grows() -> None:
    stored = SessionRecord.from_json(_stored_dict())
    older, _ = merge_record(stored, {}, [], None, 5.0, False, new=stored)
    newer, _ = merge_record(stored, {}, [], None, 1800000000.0, False, new=stored)
    assert older.last_active == stored.last_active and newer.last_active == 1800000000.0


def test_the_merge_writes_what_the_dict_merge_wrote() -> None:
    """Random pending writes over stored records give the same bytes as the pre-typed merge."""
    rng = random.Random(7)
    for _ in range(200):
        stored = rng.choice([None, _stored_dict(), _stored_dict(closed="idle", turns={}, feedback=[])])
        new_dict = _stored_dict(session_id="s1", last_active=3.0, turns={}, feedback=[], next_seq=SEQ_BLOCK)
        turns = {
            turn_id: {
                "p": rng.choice([None, "a", "b"]),
                "n": rng.randrange(5),
                "k": rng.choice([None, "ab12", "ff00"]),
                "q": [rng.randrange(10_000) for _ in range(rng.randrange(3))],
                "f": rng.random() < 0.5,
                "t": round(rng.uniform(1.7e9, 1.8e9), 3),
            }
            for turn_id in rng.sample(["a", "b", "c", "d"], rng.randrange(3))
        }
        feedback = [{"id": rng.choice(["fb1", "fb2", "fb3"]), "score": rng.random()} for _ in range(rng.randrange(3))]
        close = rng.choice([None, None, "client", "idle"])
        last_active = rng.uniform(0, 1.8e9)
        reserve = rng.random() < 0.3
        want, want_block = _legacy_merge(stored, new_dict, turns, feedback, close, last_active, reserve)
        got, block = merge_record(
            SessionRecord.from_json(stored) if stored is not None else None,
            {turn_id: TurnEntry.from_json(entry) for turn_id, entry in turns.items()},
            feedback,
            close,
            last_active,
            reserve,
            new=SessionRecord.from_json(new_dict),
        )
        assert orjson.dumps(got.to_json()) == orjson.dumps(want)
        assert block == want_block


# -- a turn and its event ---------------------------------------------------------------------------

_COMMON = {
    "schema_version": 2,
    "event_id": "e1",
    "time": 1700000005.0,
    "tenant": "t0123456789abcdef",
    "session_id": "s1",
    "seq": 7,
    "model": "tiny",
    "policy_version": 3,
}
_SAMPLING = SamplingRecord.model_construct(
    temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, seed=None, constraint=None, grammar=None
)


def _turn(turn_id: str, parent: Turn | None, finish_reason: str | None) -> Turn:
    # A thinking model's turns: the root thought for two ids then answered (and follows a turn it
    # could not continue); the aborted child was cut while still thinking.
    reused = len(parent.prompt_ids) + len(parent.output_ids) if parent is not None else 0
    prefix = (*parent.prompt_ids, *parent.output_ids) if parent is not None else ()
    return Turn(
        turn_id=turn_id,
        session_id="s1",
        parent_id=parent.turn_id if parent is not None else None,
        key=b"\x01\x02" if finish_reason else None,
        context_length=3,
        prompt_ids=(*prefix, 11, 12),
        reused_prompt_tokens=reused,
        output_ids=(21, 22, 23),
        logprobs=(-0.5, -0.25, -1.0),
        finish_reason=finish_reason,
        content="hi",
        tool_calls=(ToolCall("call_1", "f", '{"x": 1}'),),
        policy_version=3,
        policy_versions=((3, 0), (4, 2)),
        created_at=1700000004.5,
        time_to_first_token_s=0.01,
        duration_s=0.2,
        matches_full_render=True,
        fallback_reason=None,
        predecessor_id="p0" if parent is None else None,
        reasoning_tokens=2 if finish_reason else 3,
        answer_start=2 if finish_reason else None,
    )


def test_a_turn_survives_its_event_form() -> None:
    root = _turn("r", None, "stop")
    said = (TurnSignal("r0", "retried"), TurnSignal("r", "tool_error", "call_1: Error: no such file"))
    child = replace(_turn("c", root, None), abort_reason="client_disconnected", signals=said)
    completed = turn_to_event(root, _COMMON, request_id="chatcmpl-1", choice_index=0, sampling=_SAMPLING)
    aborted = turn_to_event(
        child,
        _COMMON,
        request_id="chatcmpl-2",
        choice_index=1,
        sampling=_SAMPLING,
        abort_reason="client_disconnected",
    )
    assert isinstance(completed, TurnCompleted) and isinstance(aborted, TurnAborted)
    assert aborted.reason == "client_disconnected" and aborted.prompt_ids == [11, 12]  # only what follows the parent
    assert aborted.usage.prompt_tokens == len(child.prompt_ids) and aborted.event_id == "e1" and aborted.seq == 7
    # What is stored is what is read back: through the event's JSON, validated.
    for event in (completed, aborted):
        assert type(event).model_validate_json(event.model_dump_json()) == event
    assert turn_from_event(completed, session_id="s1", parent=None, key=root.key, context_length=3) == root
    assert turn_from_event(aborted, session_id="s1", parent=root, key=None, context_length=3) == child
    # The thinking marks and the predecessor link reach a replica that replays the turn.
    assert (completed.reasoning_tokens, completed.answer_start, completed.predecessor_turn_id) == (2, 2, "p0")
    assert (aborted.reasoning_tokens, aborted.answer_start) == (3, None)
    # What its request said about earlier turns travels on its event (schema 7).
    assert [(s.turn_id, s.signal, s.detail) for s in aborted.signals] == [
        ("r0", "retried", None),
        ("r", "tool_error", "call_1: Error: no such file"),
    ]


def test_an_aborted_turn_is_cancelled_unless_told_why() -> None:
    event = turn_to_event(_turn("r", None, None), _COMMON, request_id="r", choice_index=0, sampling=_SAMPLING)
    assert isinstance(event, TurnAborted) and event.reason == "cancelled" and event.detail is None


def test_a_turn_that_reused_ids_needs_its_parent() -> None:
    root = _turn("r", None, "stop")
    event = turn_to_event(_turn("c", root, "stop"), _COMMON, request_id="r", choice_index=0, sampling=_SAMPLING)
    with pytest.raises(ValueError, match="parent"):
        turn_from_event(event, session_id="s1", parent=None, key=None, context_length=0)


def test_a_replica_without_reserved_numbers_never_takes_another_replicas() -> None:
    """A replica that took a session over while NATS was away (no block reserved: ``seq_end`` 0)
    once numbered its events from 0, the creator's numbers: the consumers kept one event of each
    pair and a turn was lost (a cluster's rolling restart)."""
    taken: set[int] = set()
    for _ in range(64):
        session = _session(seq_end=0)  # as a loading replica holds it until its first reservation
        first = session.take_seq()
        assert first >= 1 << 40 and first % SEQ_BLOCK == 0
        assert [session.take_seq() for _ in range(3)] == [first + 1, first + 2, first + 3]
        assert first not in taken  # another replica's fallback block, most likely elsewhere
        taken.add(first)
    creator = _session(seq_end=SEQ_BLOCK)
    creator.seq_next = SEQ_BLOCK  # its block used up, NATS still away
    assert creator.take_seq() >= 1 << 40
