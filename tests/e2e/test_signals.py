"""Implicit signals through the real pipeline (issue 57): gateway → NATS → assembler → reward worker
(the built-in ``signals`` scorer) → batcher → the parquet batch.

Two gateway replicas capture into one nats-server (the tiny model on the transformers engine; the
synthetic engine at a slow pace, for a stream the client walks away from). A regenerate, an edit, a
failed tool call and a client that leaves each produce their signal on the right turn: on the later
turn's event (naming the earlier one), on the earlier turn's ``signals`` in the trajectory and the
batch, and in the reward the ``signals`` scorer gives (docs/rewards.md's weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from openai import OpenAI

from consumers.assembler import AssemblerConfig, run_assembler
from consumers.batcher import BatcherConfig, run_batcher
from consumers.parquet import decode_batch
from consumers.reward_worker import RewardWorkerConfig, run_reward_worker
from consumers.scorers import parse_scorer
from consumers.trajectory import Trajectory
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import TurnRecord

from ..support.capture import read_stream
from ..support.replicas import close_session, tiny_and_slow
from ..support.waiting import wait_until

KEY = "sk-signals"
SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"], "additionalProperties": False}
PICK = {"type": "function", "function": {"name": "pick", "description": "Pick one", "parameters": SCHEMA}}
ROWS = 6  # regenerate: 2, edit: 2, tool: 1, gone: 1


@dataclass
class Pipeline:
    tiny: str
    slow: str
    batches: Path
    nats: str

    def client(self, session: str, base: str | None = None) -> OpenAI:
        return OpenAI(base_url=(base or self.tiny) + "/v1", api_key=KEY, default_headers={"x-session-id": session},
                      max_retries=0)  # fmt: skip

    def signals(self, session: str, base: str | None = None) -> list[list[str]]:
        """Each turn's signals as ``GET /sessions/{id}`` shows them, in the order the turns were made."""
        body = httpx.get(f"{base or self.tiny}/sessions/{session}", headers={"authorization": f"Bearer {KEY}"}).json()
        return [t["signals"] for t in sorted(body["turns"], key=lambda t: t["created_at"])]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Pipeline]:
    tmp = tmp_path_factory.mktemp("signals")
    with EmbeddedNatsServer() as nats, anyio.from_thread.start_blocking_portal() as portal:
        assembler = AssemblerConfig(servers=(nats.url,), idle_timeout_s=3, close_grace_s=1, aborted="keep")
        worker = RewardWorkerConfig(servers=(nats.url,), scorers=(parse_scorer("sig=signals"),), ack_wait_s=10)
        batcher = BatcherConfig.of(servers=(nats.url,), batch_size=ROWS, group_size=1, prompt_length=2048,
                                   response_length=2048, output_dir=tmp / "batches", reward="sig",
                                   await_scorers=(("sig", 30.0),))  # fmt: skip
        tasks = [
            portal.start_task_soon(run_assembler, assembler),
            portal.start_task_soon(run_reward_worker, worker),
            portal.start_task_soon(run_batcher, batcher),
        ]
        with tiny_and_slow(nats.url, tmp, tiny_model_path) as (a, b):
            yield Pipeline(a, b, tmp / "batches", nats.url)
        for task in tasks:
            task.cancel()


def _traffic(p: Pipeline) -> None:
    ask: Any = [{"role": "user", "content": "Give me a number."}]
    # A regenerate: the same request twice.
    regen = p.client("regenerate")
    for _ in range(2):
        regen.chat.completions.create(model="tiny", messages=ask, max_tokens=6)
    # An edit: the follow-up question sent, then changed and sent again.
    edit = p.client("edit")
    first = edit.chat.completions.create(model="tiny", messages=ask, max_tokens=6)
    history = [*ask, {"role": "assistant", "content": first.choices[0].message.content}]
    for follow_up in ("Another one.", "A bigger one."):
        edit.chat.completions.create(model="tiny", messages=[*history, {"role": "user", "content": follow_up}],
                                     max_tokens=6)  # fmt: skip
    # A failed tool call: the call's result begins with "Error".
    tool = p.client("tool")
    called = tool.chat.completions.create(
        model="tiny", messages=ask, tools=[PICK], max_tokens=300,  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "pick"}},
    )  # fmt: skip
    message = called.choices[0].message
    assert message.tool_calls
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Error: pick is unavailable"}
    failed = [*ask, message.model_dump(exclude_none=True), result]
    tool.chat.completions.create(model="tiny", messages=failed, tools=[PICK], max_tokens=6)  # type: ignore[list-item]
    for session in ("regenerate", "edit", "tool"):
        close_session(p.tiny, KEY, session)
    # A client that leaves mid-stream: the turn is aborted; the session ends by being idle.
    stream = p.client("gone", p.slow).chat.completions.create(model="tiny", messages=ask, max_tokens=400, stream=True)
    for count, _chunk in enumerate(stream):
        if count >= 3:
            break
    stream.close()


def _batch(p: Pipeline) -> list[Trajectory]:
    files = sorted(p.batches.glob("*.parquet")) if p.batches.exists() else []
    return [t for f in files for t in decode_batch(f.read_bytes())[0]]


@pytest.fixture(scope="module")
def rows(pipeline: Pipeline) -> dict[str, list[Trajectory]]:
    """The traffic above, as the batch the trainer gets, by session (each session's rows by start)."""
    _traffic(pipeline)
    wait_until(lambda: len(_batch(pipeline)) == ROWS, timeout=90, what="one batch of the six trajectories")
    by_session: dict[str, list[Trajectory]] = {}
    for row in sorted(_batch(pipeline), key=lambda r: (r.started_at, r.turns[-1].turn_id)):
        by_session.setdefault(row.session_id, []).append(row)
    return by_session


def _turn_signals(row: Trajectory) -> list[list[str]]:
    return [turn.signals for turn in row.turns]


def test_each_signal_is_on_the_right_turn_in_the_session_the_events_and_the_batch(
    pipeline: Pipeline, rows: dict[str, list[Trajectory]]
) -> None:
    # GET /sessions/{id}: on the turns they concern.
    assert pipeline.signals("regenerate") == [["retried"], []]
    assert pipeline.signals("edit") == [["accepted"], ["edited"], []]
    assert pipeline.signals("tool") == [["accepted", "tool_error"], []]
    assert pipeline.signals("gone", pipeline.slow) == [["abandoned"]]

    # The events: what a later request said is on its turn's record, naming the earlier turn.
    records = [e for _, e in read_stream(pipeline.nats) if isinstance(e, TurnRecord)]
    said = {(r.session_id, s.signal): (r.turn_id, s.turn_id, s.detail) for r in records for s in r.signals}
    assert set(said) == {("regenerate", "retried"), ("edit", "edited"), ("tool", "tool_error")}
    by_id = {r.turn_id: r for r in records}
    by, about, detail = said[("tool", "tool_error")]
    assert by_id[by].parent_turn_id == about and by_id[about].tool_calls  # the turn that made the failed call
    assert detail is not None and detail.endswith("Error: pick is unavailable")
    [gone] = [r for r in records if r.session_id == "gone"]
    assert gone.kind == "turn.aborted" and gone.reason == "client_disconnected"  # type: ignore[attr-defined]

    # The batch: every turn carries its signals.
    assert [_turn_signals(r) for r in rows["regenerate"]] == [[["retried"]], [[]]]
    assert sorted(_turn_signals(r) for r in rows["edit"]) == [[["accepted"], []], [["accepted"], ["edited"]]]
    assert [_turn_signals(r) for r in rows["tool"]] == [[["accepted", "tool_error"], []]]
    assert [_turn_signals(r) for r in rows["gone"]] == [[["abandoned"]]]


def test_the_signals_scorer_gives_the_documented_reward(rows: dict[str, list[Trajectory]]) -> None:
    """Each turn scores the sum of its signals' weights (accepted +1, retried -1, edited -0.5,
    tool_error -0.5, abandoned -1), clamped to [-1, 1]; a trajectory the mean over its turns."""
    rewards = {session: sorted(r.reward for r in mine if r.reward is not None) for session, mine in rows.items()}
    assert rewards == {
        "regenerate": [-1.0, 0.0],
        "edit": [(1.0 - 0.5) / 2, (1.0 + 0.0) / 2],
        "tool": [(1.0 - 0.5 + 0.0) / 2],
        "gone": [-1.0],
    }
    assert {r.reward_source for mine in rows.values() for r in mine} == {"sig"}
    # Per turn, aligned with the turn's tokens (process rewards).
    [tool] = rows["tool"]
    assert [t.reward for t in tool.turns] == [0.5, 0.0]
