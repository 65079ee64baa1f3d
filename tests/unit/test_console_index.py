"""The console's index (stream_stack/console/_index.py) on real events: what a page filters and
pages on, written idempotently, and a forgotten session gone for good."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from pipeline.events import SessionClosed, SessionOpened, TurnStarted, tenant_id
from stream_stack.console import ConsoleIndex, SessionFilter

from ..support.events import SAMPLING, common, one_of_each, turn_completed

OTHER = tenant_id("sk-other")


def _trajectory(session: str, tenant: str, turn_ids: list[str], health: list[str]) -> dict[str, Any]:
    return {
        "trajectory_id": f"tr-{session}-{len(turn_ids)}", "tenant": tenant, "session_id": session, "model": "tiny",
        "token_ids": [1, 2, 3, 7, 8], "loss_mask": [0, 0, 0, 1, 1], "turns": [{"turn_id": t} for t in turn_ids],
        "reward": None, "health": health, "ended_at": 1_750_000_001.0, "min_policy_version": 3,
        "max_policy_version": 4, "adapter": None,
    }  # fmt: skip


def test_sessions_turns_trajectories_and_batches_are_indexed_once(tmp_path: Path) -> None:
    index = ConsoleIndex(tmp_path / "console.sqlite")
    events = [(i + 1, "event", e) for i, e in enumerate(one_of_each("s1"))]
    events.append((len(events) + 1, "event", turn_completed("s1", 7, turn_id="turn-3", parent_turn_id="turn-1",
                                                             reused=7)))  # fmt: skip
    index.apply("SG_EVENTS", events)
    index.apply("SG_EVENTS", events)  # a redelivery changes nothing
    index.apply("SG_TRAJECTORIES", [(1, "trajectory", _trajectory("s1", events[0][2].tenant, ["turn-1", "turn-3"],
                                                                    ["no-reward"]))])  # fmt: skip
    index.apply("SG_BATCHES", [(1, "batch", {"batch_id": "b1", "trajectory_ids": ["tr-s1-2"], "created_at": 1.0,
                                             "min_policy_version": 3, "max_policy_version": 4})])  # fmt: skip
    assert index.position("SG_EVENTS") == len(events) and index.position("SG_BATCHES") == 1
    [session] = index.sessions(SessionFilter(), before=None, limit=50)
    assert session["agent"] == "pytest/1.0" and session["metadata"] == {"group": "g1"}
    assert session["closed"] == "client" and session["turns"] == 3  # turn-1, turn-2 (aborted), turn-3
    assert set(session["health"]) == {"no-reward", "aborted-turn"}
    turns = index.turns(session["tenant"], "s1", offset=0, limit=10)
    assert [t["turn_id"] for t in turns if t["state"] == "completed"] == ["turn-1", "turn-3"]
    assert turns[0]["tool_calls"] == ["read"]
    found = index.session(None, "s1")
    assert found is not None and found["trajectories"][0]["batch_id"] == "b1"
    loop = index.loop(None)
    assert loop["replicas"][0]["replica"] == "host-1" and loop["batches"][0]["lag"] == 0


def test_a_batch_indexed_before_its_trajectories_still_marks_them(tmp_path: Path) -> None:
    """The console reads the trajectories and batches streams apart: on a busy machine a batch's
    manifest was indexed first, and the trajectory that came after never showed its batch."""
    path = tmp_path / "console.sqlite"
    index = ConsoleIndex(path)
    events = [(i + 1, "event", e) for i, e in enumerate(one_of_each("s1"))]
    index.apply("SG_EVENTS", events)
    tenant = events[0][2].tenant
    index.apply("SG_BATCHES", [(1, "batch", {"batch_id": "b1", "trajectory_ids": ["tr-s1-1", "tr-s1-2"]})])
    index.apply("SG_TRAJECTORIES", [(1, "trajectory", _trajectory("s1", tenant, ["turn-1"], []))])
    index.apply("SG_TRAJECTORIES", [(2, "trajectory", _trajectory("s1", tenant, ["turn-1", "turn-3"], []))])
    found = index.session(None, "s1")
    assert found is not None and [t["batch_id"] for t in found["trajectories"]] == ["b1", "b1"]
    index.close()
    # An index file made before members were kept learns them from its batches when opened.
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM batch_members")
        db.execute("UPDATE trajectories SET batch_id = NULL")
    reopened = ConsoleIndex(path)
    reopened.apply("SG_TRAJECTORIES", [(3, "trajectory", _trajectory("s1", tenant, ["turn-1", "turn-3"], []))])
    found = reopened.session(None, "s1")
    assert found is not None and "b1" in [t["batch_id"] for t in found["trajectories"]]


def test_a_live_turn_is_counted_until_its_record_arrives() -> None:
    index = ConsoleIndex(None)
    opened = SessionOpened(**common("s2", 0))
    started = TurnStarted(**common("s2", 1), turn_id="turn-1", parent_turn_id=None, request_id="r", choice_index=0,
                          prompt_tokens=4, reused_prompt_tokens=0, sampling=SAMPLING)  # fmt: skip
    index.apply("SG_EVENTS", [(1, "event", opened), (2, "event", started)])
    [row] = index.sessions(SessionFilter(), before=None, limit=5)
    assert (row["turns"], row["live"]) == (0, 1)
    index.apply("SG_EVENTS", [(3, "event", turn_completed("s2", 2))])
    [row] = index.sessions(SessionFilter(), before=None, limit=5)
    assert (row["turns"], row["live"]) == (1, 0)


def test_pages_are_keyset_paged_and_filtered_by_tenant_flag_and_status() -> None:
    index = ConsoleIndex(None)
    rows = [(OTHER if i % 3 == 0 else "tmine", f"s{i:03d}", "tiny", "pi", float(i), float(i), 1,
             " forked " if i % 5 == 0 else " ") for i in range(120)]  # fmt: skip
    index.insert_sessions(rows)
    seen: list[str] = []
    before = None
    while True:
        page = index.sessions(SessionFilter(tenant="tmine"), before=before, limit=25)
        seen += [r["session_id"] for r in page]
        if len(page) < 25:
            break
        before = (page[-1]["last_at"], page[-1]["session_id"])
    mine = [f"s{i:03d}" for i in range(120) if i % 3]
    assert seen == sorted(mine, reverse=True)  # every row once, newest first
    assert index.count(SessionFilter(tenant="tmine")) == len(mine)
    assert index.count(SessionFilter(tenant="tmine", flag="forked")) == sum(
        1 for i in range(120) if i % 3 and i % 5 == 0
    )
    assert index.count(SessionFilter(flag="fork")) == 0  # a flag is matched whole
    assert index.count(SessionFilter(status="closed")) == 0
    assert index.count(SessionFilter(text="s11_")) == 0 and index.count(SessionFilter(text="s11")) == 10
    closed = SessionClosed(**common("s001", 9, "tmine"), reason="idle", turns=1)
    index.apply("SG_EVENTS", [(1, "event", closed)])
    assert index.count(SessionFilter(status="closed")) == 1


def test_a_forgotten_session_leaves_the_index_and_never_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "console.sqlite"
    index = ConsoleIndex(path)
    events = [(i + 1, "event", e) for i, e in enumerate(one_of_each("gone"))]
    index.apply("SG_EVENTS", events)
    tenant = events[0][2].tenant
    index.forget(tenant, "gone")
    assert index.session(None, "gone") is None and index.turns(tenant, "gone", offset=0, limit=9) == []
    index.close()
    again = ConsoleIndex(path)  # a restart remembers it
    again.apply("SG_EVENTS", [(99, "event", turn_completed("gone", 20, turn_id="late"))])
    again.apply("SG_TRAJECTORIES", [(5, "trajectory", _trajectory("gone", tenant, ["late"], []))])
    assert again.session(None, "gone") is None and again.trajectory("tr-gone-1") is None
