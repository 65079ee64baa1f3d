"""The trajectory assembler against a real nats-server and real gateway traffic."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import nats
import numpy as np
import orjson
import pydantic
import pytest
from openai import OpenAI

from consumers.assembler import Assembler, AssemblerConfig, run_assembler
from consumers.trajectories import SessionEvents, build_trajectories
from consumers.trajectory import TRAJECTORY_SCHEMA_VERSION, ExpertRoutes, Trajectory
from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig
from pipeline.events import Event, SessionClosed, TurnCompleted, decode_event, encode_event
from pipeline.publisher import EventPublisher, PublisherConfig
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import read_trajectories
from ..support.servers import RunningGateway, run_gateway

KEY = "sk-assembler"


def read_events(url: str) -> list[Event]:
    from ..support.capture import read_stream

    return [e for _, e in read_stream(url)]


def wait_for(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    raise AssertionError("timed out")


@contextmanager
def background_assembler(config: AssemblerConfig) -> Iterator[None]:
    """An assembler on its own event loop in a thread (like the test gateway), cancelled on exit."""
    with anyio.from_thread.start_blocking_portal() as portal:
        future = portal.start_task_soon(run_assembler, config)
        try:
            yield
        finally:
            future.cancel()
            with contextlib.suppress(concurrent.futures.CancelledError):
                future.result(timeout=20)


@pytest.fixture
def capture_gateway(nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningGateway]:
    settings = Settings(
        model=str(tiny_model_path), served_model_name="tiny", nats_url=nats_server.url, outbox_dir=tmp_path / "outbox"
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _turn(client: OpenAI, messages: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, seed=seed)  # type: ignore[arg-type]
    return {"role": "assistant", "content": reply.choices[0].message.content}


def test_gateway_sessions_become_their_chains_token_for_token(
    capture_gateway: RunningGateway, nats_server: EmbeddedNatsServer
) -> None:
    """A tree (a retry from an older turn) gives one trajectory per chain, equal to the gateway's."""
    session_id = f"asm{secrets.token_hex(4)}"
    base = f"{capture_gateway.base_url}/sessions/{session_id}"
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
    first = [{"role": "user", "content": "Plan a trip."}]
    first.append(_turn(client, first, 1))
    second = [*first, {"role": "user", "content": "Go on."}]
    second.append(_turn(client, second, 2))
    _turn(client, [*second, {"role": "user", "content": "And then?"}], 3)
    _turn(client, [*first, {"role": "user", "content": "Something else."}], 4)  # a branch off turn 1
    body = httpx.get(base, headers={"authorization": f"Bearer {KEY}"}).json()
    turn_ids = [t["turn_id"] for t in body["turns"]]
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/turns/{turn_ids[1]}/feedback", json={"score": 0.25}, headers=headers).is_success
    assert httpx.post(f"{base}/feedback", json={"score": 1.0}, headers=headers).is_success
    assert httpx.post(f"{base}/close", headers=headers).is_success

    config = AssemblerConfig(servers=(nats_server.url,), durable=f"asm{secrets.token_hex(3)}", ack_wait_s=5)
    with background_assembler(config):
        mine = wait_for(lambda: [t for t in read_trajectories(nats_server.url) if t.session_id == session_id])
    chains = {tuple(c["turn_ids"]): c for c in body["chains"]}
    assert len(mine) == len(chains) == 2
    trained: dict[str, list[str]] = {}  # turn id -> the trajectories whose loss holds it
    for trajectory in mine:
        chain = chains[tuple(s.turn_id for s in trajectory.turns)]
        assert trajectory.token_ids == chain["token_ids"]
        # Train-once: the gateway's chain mask, but a turn the first chain holds too is out of the later one's loss.
        expected = list(chain["mask"])
        for summary in trajectory.turns:
            if summary.trained:
                trained.setdefault(summary.turn_id, []).append(trajectory.trajectory_id)
            else:
                expected[summary.start : summary.start + summary.length] = [0] * summary.length
        assert trajectory.loss_mask == expected
        assert trajectory.logprobs == chain["logprobs"]  # a shared turn keeps its logprobs
        assert "forked" in trajectory.health and trajectory.end_reason == "length"
        assert trajectory.prompt_length == len(body["turns"][0]["prompt_ids"])
        assert (trajectory.reward, trajectory.reward_source, trajectory.emitted_because) == (1.0, "feedback", "closed")
        assert trajectory.complete and not trajectory.truncated
        # The second turn's feedback (0.25) lands on it, in the one chain that holds it; no other turn has any.
        rewards = {s.turn_id: s.reward for s in trajectory.turns}
        assert (turn_ids[1] in rewards) == (trajectory.num_turns == 3)
        assert rewards == {turn_id: 0.25 if turn_id == turn_ids[1] else None for turn_id in rewards}
        assert trajectory.num_turns == len(trajectory.turns)
    assert {t.num_turns for t in mine} == {3, 2}
    assert sorted(trained) == sorted(turn_ids) and all(len(owners) == 1 for owners in trained.values())
    assert sum(not s.trained for t in mine for s in t.turns) == 1  # turn 1, in the later chain


def _fake_session(session_id: str, turns: int, rng: random.Random, *, close: bool = True) -> list[Event]:
    """A session's events as the gateway would publish them (no model needed)."""
    from stream_gateway.capture._recorder import EventRecorder
    from stream_gateway.engines import SamplingParams
    from stream_gateway.sessions._store import Session, Turn

    events: list[Event] = []
    recorder = EventRecorder(events.append, "fake")
    session = Session(session_id, "sk-fake", time.time(), time.time())
    recorder.session_opened(session, 0, "test-agent", {"group": "g1"})
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=0, seed=None, top_logprobs=0)
    parent: Turn | None = None
    for i in range(turns):
        appended = [rng.randrange(2000) for _ in range(rng.randint(3, 12))]
        prompt = (*parent.prompt_ids, *parent.output_ids, *appended) if parent else tuple(appended)
        output = tuple(rng.randrange(2000) for _ in range(rng.randint(1, 8)))
        turn = Turn(
            turn_id=f"turn{session_id}{i}",
            session_id=session_id,
            parent_id=parent.turn_id if parent else None,
            key=None,
            context_length=2 * i + 1,
            prompt_ids=prompt,
            reused_prompt_tokens=len(parent.prompt_ids) + len(parent.output_ids) if parent else 0,
            output_ids=output,
            logprobs=tuple(-rng.random() for _ in output),
            finish_reason="stop",
            content="x",
            tool_calls=(),
            policy_version=0,
            policy_versions=((0, 0),),
            created_at=time.time() + i,
            time_to_first_token_s=0.01,
            duration_s=0.1,
            matches_full_render=True,
            fallback_reason=None,
        )
        recorder.turn_started(
            session, turn.turn_id, turn.parent_id, "req", 0, len(prompt), turn.reused_prompt_tokens, params, 0
        )
        session.turns[turn.turn_id] = turn
        recorder.turn_finished(session, turn, "req", 0, params, None)
        parent = turn
    if rng.random() < 0.5:
        recorder.feedback(session, 0, None, rng.choice([-1.0, 1.0]), None, None, "user")
    if close:
        recorder.session_closed(session, 0, "client")
    return events


def test_out_of_order_and_duplicated_events_give_identical_trajectories() -> None:
    rng = random.Random(5)
    events = _fake_session("ooo", 4, rng)
    expected = build_trajectories(SessionEvents.of(events), emitted_because="closed")
    assert len(expected) == 1 and expected[0].num_turns == 4
    for _ in range(20):
        shuffled = events + rng.sample(events, k=len(events) // 2)
        rng.shuffle(shuffled)
        assert build_trajectories(SessionEvents.of(shuffled), emitted_because="closed") == expected


def _thinking_turn(
    turn: TurnCompleted, reasoning_tokens: int, answer_start: int | None, **changes: Any
) -> TurnCompleted:
    """``turn`` as a reasoning model's (validated, as a consumer decodes it)."""
    fields = turn.model_dump() | {"reasoning_tokens": reasoning_tokens, "answer_start": answer_start} | changes
    return TurnCompleted.model_validate(fields)


def _thinking_session() -> list[Event]:
    """A root that thinks 3 of its 4 ids then answers, and a child cut off (length) while thinking."""
    from ..support.events import turn_completed

    root = _thinking_turn(turn_completed(seq=1, turn_id="a", prompt_ids=[1, 2, 3, 4], output_ids=[7, 8, 9, 10]), 3, 3)
    child = turn_completed(
        seq=2, turn_id="b", parent_turn_id="a", reused=8, prompt_ids=[11, 12], output_ids=[13, 14, 15]
    )
    child = _thinking_turn(child, 3, None, started_at=root.started_at + 1, finish_reason="length")
    return [root, child]


def test_thinking_turns_mark_the_trajectorys_reasoning_mask() -> None:
    """Each turn's first ``reasoning_tokens`` sampled ids are 1 in ``reasoning_mask``; they stay in the loss mask."""
    [trajectory] = build_trajectories(SessionEvents.of(_thinking_session()), emitted_because="closed")
    assert trajectory.schema_version == TRAJECTORY_SCHEMA_VERSION == 6
    assert trajectory.token_ids == [1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert trajectory.loss_mask == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    assert trajectory.reasoning_mask == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert [(t.start, t.length, t.reasoning_tokens, t.answer_start) for t in trajectory.turns] == [
        (4, 4, 3, 3),
        (10, 3, 3, None),
    ]
    assert Trajectory.decode(trajectory.encode()) == trajectory
    # A token cap cuts the mask with the ids.
    [cut] = build_trajectories(SessionEvents.of(_thinking_session()), emitted_because="closed", max_tokens=11)
    assert cut.truncated and cut.reasoning_mask == trajectory.reasoning_mask[:11]


def test_schema_2_events_and_trajectories_decode_with_no_thinking() -> None:
    """What was written before thinking spans reads with zeros: events (0, 0) and trajectories (mask all 0)."""
    old_events = []
    for event in _thinking_session():
        wire = orjson.loads(encode_event(event))
        for field in ("reasoning_tokens", "answer_start", "predecessor_turn_id"):
            del wire[field]
        decoded = decode_event(orjson.dumps(wire | {"schema_version": 2}))
        assert isinstance(decoded, TurnCompleted) and (decoded.reasoning_tokens, decoded.answer_start) == (0, 0)
        old_events.append(decoded)
    [from_old] = build_trajectories(SessionEvents.of(old_events), emitted_because="closed")
    assert from_old.reasoning_mask == [0] * len(from_old.token_ids) and 1 in from_old.loss_mask
    assert [(t.reasoning_tokens, t.answer_start) for t in from_old.turns] == [(0, 0), (0, 0)]

    [trajectory] = build_trajectories(SessionEvents.of(_thinking_session()), emitted_because="closed")
    wire = orjson.loads(trajectory.encode())
    del wire["reasoning_mask"]
    for turn in wire["turns"]:
        del turn["reasoning_tokens"], turn["answer_start"]
    old = Trajectory.decode(orjson.dumps(wire | {"schema_version": 2}))
    assert old.schema_version == 2 and old.reasoning_mask == [0] * len(old.token_ids)
    assert [(t.reasoning_tokens, t.answer_start) for t in old.turns] == [(0, 0), (0, 0)]
    assert old.model_copy(update={"schema_version": TRAJECTORY_SCHEMA_VERSION}) == from_old  # all else as written


# -- LoRA adapters (event and trajectory schema 4) -------------------------------------------------


def _on_adapter(
    turn: TurnCompleted, adapter: str | None, spans: list[tuple[int, int]], **changes: Any
) -> TurnCompleted:
    """``turn`` as sampled by LoRA ``adapter`` (``None``: the base) at that adapter's versions ``spans``."""
    fields = turn.model_dump() | {"adapter": adapter, "policy_versions": spans, "policy_version": spans[0][0]}
    return TurnCompleted.model_validate(fields | changes)


def _adapter_session(root: str | None, child: str | None) -> list[Event]:
    """A root at versions 2 then 3 (from its third id) of ``root``, and a child at version 5 of ``child``."""
    from ..support.events import turn_completed

    first = _on_adapter(
        turn_completed(seq=1, turn_id="a", prompt_ids=[1, 2, 3, 4], output_ids=[7, 8, 9, 10]), root, [(2, 0), (3, 2)]
    )
    second = turn_completed(
        seq=2, turn_id="b", parent_turn_id="a", reused=8, prompt_ids=[11, 12], output_ids=[13, 14, 15]
    )
    return [first, _on_adapter(second, child, [(5, 0)], started_at=first.started_at + 1)]


def test_a_chain_carries_its_adapter_and_that_adapters_versions() -> None:
    [alpha] = build_trajectories(SessionEvents.of(_adapter_session("alpha", "alpha")), emitted_because="closed")
    assert alpha.adapter == "alpha" and (alpha.min_policy_version, alpha.max_policy_version) == (2, 5)
    assert alpha.token_policy_versions()[4:] == [2, 2, 3, 3, -1, -1, 5, 5, 5]
    assert orjson.loads(alpha.encode())["adapter"] == "alpha" and Trajectory.decode(alpha.encode()) == alpha
    # The base model's chain: the same ids and versions (its own sequence), adapter null.
    [base] = build_trajectories(SessionEvents.of(_adapter_session(None, None)), emitted_because="closed")
    assert base.adapter is None and base.model_copy(update={"adapter": "alpha"}) == alpha


def test_a_chain_mixing_adapters_takes_the_leafs_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """It should not happen (a session keeps its first turn's adapter); if it does, the leaf's adapter
    and only its versions: the base's 2 and 3 are not alpha's."""
    caplog.set_level(logging.WARNING, logger="consumers.trajectories")
    [mixed] = build_trajectories(SessionEvents.of(_adapter_session(None, "alpha")), emitted_because="closed")
    assert mixed.adapter == "alpha" and (mixed.min_policy_version, mixed.max_policy_version) == (5, 5)
    assert [turn.policy_versions for turn in mixed.turns] == [[(2, 0), (3, 2)], [(5, 0)]]  # the record stays whole
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        "session sess-1: chain ending in turn b mixes LoRA adapters (the base model besides adapter 'alpha'): "
        "it takes the leaf's"
    )
    caplog.clear()
    [to_base] = build_trajectories(SessionEvents.of(_adapter_session("beta", None)), emitted_because="closed")
    assert to_base.adapter is None and (to_base.min_policy_version, to_base.max_policy_version) == (5, 5)
    assert "(adapter 'beta' besides the base model)" in caplog.text
    # A chain of one adapter says nothing.
    caplog.clear()
    build_trajectories(SessionEvents.of(_adapter_session("beta", "beta")), emitted_because="closed")
    assert not caplog.records


def test_events_and_trajectories_written_before_adapters_decode_as_the_base_models() -> None:
    old_events = []
    for event in _adapter_session(None, None):
        wire = orjson.loads(encode_event(event))
        del wire["adapter"]
        decoded = decode_event(orjson.dumps(wire | {"schema_version": 3}))
        assert isinstance(decoded, TurnCompleted) and decoded.adapter is None
        old_events.append(decoded)
    [from_old] = build_trajectories(SessionEvents.of(old_events), emitted_because="closed")
    assert from_old.adapter is None and (from_old.min_policy_version, from_old.max_policy_version) == (2, 5)

    [alpha] = build_trajectories(SessionEvents.of(_adapter_session("alpha", "alpha")), emitted_because="closed")
    wire = orjson.loads(alpha.encode())
    del wire["adapter"]
    for version in (3, 4):
        old = Trajectory.decode(orjson.dumps(wire | {"schema_version": version}))
        assert old.schema_version == version and old.adapter is None
    assert Trajectory.decode(orjson.dumps(wire)).model_copy(update={"adapter": "alpha"}) == alpha


# -- routed experts (mixture-of-experts models; event and trajectory schema 4) ----------------------

LAYERS, TOP_K, EXPERTS = 2, 2, 8  # a tiny MoE: 2 MoE layers, top-2 of 8 experts


def _route_rows(rows: int, seed: int, *, layers: int = LAYERS, dtype: str = "uint8") -> np.ndarray:
    """``rows`` routes of ``TOP_K`` distinct experts per layer, as an engine reports them."""
    rng = np.random.default_rng(seed)
    picks = [rng.choice(EXPERTS, size=TOP_K, replace=False) for _ in range(rows * layers)]
    return np.array(picks, dtype=dtype).reshape(rows, layers, TOP_K)


def _with_routes(turn: TurnCompleted, rows: np.ndarray | None, **changes: Any) -> TurnCompleted:
    """``turn`` with the routes of the positions it ran first (validated, as a consumer decodes it)."""
    routes = None
    if rows is not None:
        start = max(turn.reused_prompt_tokens - 1, 0)
        routes = ExpertRoutes.of(rows).model_dump() | {"start": start}
    return TurnCompleted.model_validate(turn.model_dump() | {"routed_experts": routes} | changes)


def _routed_session(
    *, child_routes: bool = True, child_layers: int = LAYERS, branch: bool = False
) -> tuple[list[Event], dict[str, np.ndarray]]:
    """A root that calls a tool, a continuation after the tool result (and maybe a retry of it).

    root: prompt [1..4], output [7, 8, 9] (ran positions 0..6: 6 rows, the last output id never fed);
    child: reuses those 7, appends the tool result [11, 12], samples [13, 14, 15] (rows from 6,
    the root's last output id, to 10). The expected routes of each chain, by its leaf turn id.
    """
    from ..support.events import turn_completed

    root_rows = _route_rows(6, 1)
    root = _with_routes(turn_completed(seq=1, turn_id="a", prompt_ids=[1, 2, 3, 4], output_ids=[7, 8, 9]), root_rows)
    child_rows = _route_rows(5, 2, layers=child_layers)
    child = turn_completed(
        seq=2, turn_id="b", parent_turn_id="a", reused=7, prompt_ids=[11, 12], output_ids=[13, 14, 15]
    )
    child = _with_routes(
        child, child_rows if child_routes else None, started_at=root.started_at + 1, finish_reason="stop"
    )
    events: list[Event] = [root, child]
    expected = {"b": np.concatenate([root_rows, child_rows])} if child_layers == LAYERS else {}
    if branch:  # a retry of the continuation with another tool result: a second chain sharing the root's rows
        retry_rows = _route_rows(4, 3)
        retry = turn_completed(
            seq=3, turn_id="c", parent_turn_id="a", reused=7, prompt_ids=[21], output_ids=[22, 23, 24]
        )
        events.append(_with_routes(retry, retry_rows, started_at=root.started_at + 2, finish_reason="stop"))
        expected["c"] = np.concatenate([root_rows, retry_rows])
    return events, expected


def test_a_chains_routes_are_its_turns_rows_end_to_end() -> None:
    """Root rows then the continuation's (from the root's last output id): one row per id but the last."""
    events, expected = _routed_session(branch=True)
    unrouted: list[str] = []
    trajectories = build_trajectories(SessionEvents.of(events), emitted_because="closed", on_unrouted=unrouted.append)
    assert len(trajectories) == 2 and not unrouted
    for trajectory in trajectories:
        routes = trajectory.routed_experts
        assert trajectory.schema_version == TRAJECTORY_SCHEMA_VERSION and routes is not None
        assert routes.shape == (len(trajectory.token_ids) - 1, LAYERS, TOP_K) and routes.dtype == "uint8"
        assert np.array_equal(routes.array(), expected[trajectory.turns[-1].turn_id])
        assert Trajectory.decode(trajectory.encode()) == trajectory
    by_leaf = {t.turns[-1].turn_id: t for t in trajectories}
    assert by_leaf["b"].token_ids == [1, 2, 3, 4, 7, 8, 9, 11, 12, 13, 14, 15]
    # Row 6 routed the root's last output id (9) when the continuation fed it: the child's first row.
    assert np.array_equal(by_leaf["b"].routed_experts.array()[6], _route_rows(5, 2)[0])  # type: ignore[union-attr]

    # A token cap cuts the routes with the ids: one row per kept id but the last.
    [cut] = build_trajectories(SessionEvents.of(events[:2]), emitted_because="closed", max_tokens=9)
    assert cut.truncated and cut.routed_experts is not None and cut.routed_experts.shape == (8, LAYERS, TOP_K)
    assert np.array_equal(cut.routed_experts.array(), expected["b"][:8])

    # uint16 routes (over 256 experts) in one turn: the chain's are uint16, values unchanged.
    wide = [events[0], _with_routes(events[1], _route_rows(5, 2, dtype="uint16"))]  # type: ignore[arg-type]
    [widened] = build_trajectories(SessionEvents.of(wide), emitted_because="closed")
    assert widened.routed_experts is not None and widened.routed_experts.dtype == "uint16"
    assert np.array_equal(widened.routed_experts.array(), expected["b"])


@pytest.mark.parametrize(
    ("session", "reason"),
    [
        ({"child_routes": False}, "turn b has no routed_experts while others of its chain do"),
        ({"child_layers": 3}, "turn b has routes of [3, 2] (layers, top_k), not [2, 2]"),
    ],
)
def test_a_chain_whose_routes_do_not_join_up_has_none(
    session: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Logged and reported, never raised: the ids and masks are still exact."""
    events, _ = _routed_session(**session)
    unrouted: list[str] = []
    [trajectory] = build_trajectories(SessionEvents.of(events), emitted_because="closed", on_unrouted=unrouted.append)
    assert trajectory.routed_experts is None and trajectory.num_turns == 2
    assert unrouted == [reason] and reason in caplog.text
    # A dense model's chain (no routes anywhere) has none, silently.
    dense = [_with_routes(e, None) for e in events if isinstance(e, TurnCompleted)]
    [plain] = build_trajectories(SessionEvents.of(dense), emitted_because="closed", on_unrouted=unrouted.append)
    assert plain.routed_experts is None and len(unrouted) == 1
    # The same ids and masks; only the health says the routed chain lost its routes.
    assert "no-routes" in trajectory.health and "no-routes" not in plain.health
    assert plain == trajectory.model_copy(update={"health": [f for f in trajectory.health if f != "no-routes"]})


def test_schema_3_trajectories_decode_with_no_routes_and_wrong_row_counts_are_refused() -> None:
    events, _ = _routed_session()
    [trajectory] = build_trajectories(SessionEvents.of(events), emitted_because="closed")
    wire = orjson.loads(trajectory.encode())
    assert wire["routed_experts"]["shape"] == [11, LAYERS, TOP_K] and "start" not in wire["routed_experts"]
    old = {k: v for k, v in wire.items() if k != "routed_experts"} | {"schema_version": 3}
    decoded = Trajectory.decode(orjson.dumps(old))
    assert decoded.schema_version == 3 and decoded.routed_experts is None
    assert (
        decoded.model_copy(
            update={"schema_version": TRAJECTORY_SCHEMA_VERSION, "routed_experts": trajectory.routed_experts}
        )
        == trajectory
    )
    # One row too few (the last id's row is never recorded, so len(token_ids) - 1 exactly), or bad data.
    short = ExpertRoutes.of(trajectory.routed_experts.array()[:-1]).model_dump()  # type: ignore[union-attr]
    with pytest.raises(pydantic.ValidationError, match="10 rows for 12 token ids"):
        Trajectory.decode(orjson.dumps(wire | {"routed_experts": short}))
    with pytest.raises(pydantic.ValidationError, match="does not hold 44 bytes"):
        Trajectory.decode(orjson.dumps(wire | {"routed_experts": wire["routed_experts"] | {"data": "AAAA"}}))


def test_routes_through_a_real_stream_and_the_object_store(tmp_path: Path) -> None:
    """Events and trajectories over the server's max payload (routes are large) travel whole.

    48 MoE layers x top-8 (Qwen3-30B-A3B's shape) over a 300-id turn: ~115 KB of routes, over
    a 64 KiB max payload, so the event and the trajectory both go through the object stores.
    A second session's continuation lacks routes: its trajectory has none and is counted.
    """
    from ..support.events import turn_completed

    rng = np.random.default_rng(7)
    big = rng.integers(0, 128, size=(299, 48, 8), dtype=np.uint8)
    root = turn_completed("big", seq=0, turn_id="big-a", prompt_ids=list(range(1, 290)), output_ids=list(range(11)))
    routed_root = _with_routes(root, big)
    partial, _ = _routed_session(child_routes=False)
    partial = [
        e.model_copy(update={"session_id": "partial", "event_id": e.event_id + "p", "seq": i})
        for i, e in enumerate(partial)
    ]
    closes = [
        SessionClosed(**e.model_dump(include={"tenant", "model", "policy_version", "time"}), event_id=f"close{i}",
                      session_id=sid, seq=seq, reason="client", turns=n)
        for i, (e, sid, seq, n) in enumerate([(routed_root, "big", 1, 1), (partial[0], "partial", 2, 2)])
    ]  # fmt: skip
    assert len(encode_event(routed_root)) > 64 * 1024
    with EmbeddedNatsServer(NatsServerConfig(max_payload=64 * 1024)) as server:
        anyio.run(_publish, server.url, tmp_path / "outbox", [routed_root, *partial, *closes])
        assembler = Assembler(AssemblerConfig(servers=(server.url,), ack_wait_s=5, close_grace_s=1))
        with anyio.from_thread.start_blocking_portal() as portal:
            future = portal.start_task_soon(assembler.run)
            try:
                got = wait_for(lambda: (ts := read_trajectories(server.url)) and len(ts) >= 2 and ts, timeout=30)
            finally:
                future.cancel()
                with contextlib.suppress(concurrent.futures.CancelledError):
                    future.result(timeout=20)
    by_session = {t.session_id: t for t in got}
    routes = by_session["big"].routed_experts
    assert routes is not None and routes.shape == (299, 48, 8) and np.array_equal(routes.array(), big)
    assert len(by_session["big"].encode()) > 64 * 1024  # so it was published through the object store
    assert by_session["partial"].routed_experts is None and by_session["partial"].num_turns == 2
    assert assembler.statistics().unrouted == 1
    assert assembler.statistics().health.get("no-routes") == 1 and "no-routes" in by_session["partial"].health
    assert sum(assembler.statistics().end_reasons.values()) == 2


async def _publish(url: str, outbox: Path, events: list[Event]) -> None:
    async with EventPublisher(PublisherConfig(servers=(url,), outbox_dir=outbox)) as publisher:
        for event in events:
            publisher.publish_nowait(event)
        await publisher.wait_published()


@pytest.mark.parametrize("instances", [1, 3])
def test_replayed_shuffled_and_duplicated_events_on_the_stream(tmp_path: Path, instances: int) -> None:
    """Events delivered out of order, and twice, through a real stream: the same trajectories.

    With three instances sharing the durable consumer, one session's events are spread over
    them; the compare-and-set state still gives each trajectory exactly once.
    """
    rng = random.Random(9)
    sessions = [_fake_session(f"dup{i}", rng.randint(1, 4), rng) for i in range(6 * instances)]
    expected = {
        t.trajectory_id: t for s in sessions for t in build_trajectories(SessionEvents.of(s), emitted_because="closed")
    }
    stream_order = [e for s in sessions for e in s]
    rng.shuffle(stream_order)
    copies = [e.model_copy(update={"event_id": e.event_id + "copy"}) for e in rng.sample(stream_order, 10)]
    with EmbeddedNatsServer() as server:
        anyio.run(_publish, server.url, tmp_path / "outbox", stream_order + copies)
        config = AssemblerConfig(servers=(server.url,), ack_wait_s=5, close_grace_s=1, fetch_batch=4)
        with contextlib.ExitStack() as stack:
            for _ in range(instances):
                stack.enter_context(background_assembler(config))
            got = wait_for(lambda: (ts := read_trajectories(server.url)) and len(ts) >= len(expected) and ts)
            time.sleep(1)  # nothing more may come
            got = read_trajectories(server.url)
    assert sorted(t.trajectory_id for t in got) == sorted(expected)
    for trajectory in got:
        assert trajectory == expected[trajectory.trajectory_id]


async def _async_reward(trajectory: Trajectory) -> float:
    await anyio.lowlevel.checkpoint()
    return float(len(trajectory.token_ids) % 7)


def test_idle_sessions_caps_and_reward_functions(tmp_path: Path) -> None:
    rng = random.Random(3)
    idle = _fake_session("idle1", 2, rng, close=False)
    capped = _fake_session("cap1", 5, rng, close=False)
    with EmbeddedNatsServer() as server:
        anyio.run(_publish, server.url, tmp_path / "outbox", idle + capped)
        config = AssemblerConfig(
            servers=(server.url,),
            idle_timeout_s=1.5,
            max_turns=3,
            reward_function=f"{__name__}:_async_reward",
        )
        with background_assembler(config):
            got = wait_for(lambda: (ts := read_trajectories(server.url)) and len(ts) >= 2 and ts, timeout=30)
    by_session = {t.session_id: t for t in got}
    assert by_session["idle1"].emitted_because == "idle" and by_session["idle1"].num_turns == 2
    assert (
        by_session["cap1"].emitted_because == "cap"
        and by_session["cap1"].truncated
        and by_session["cap1"].num_turns == 3
    )
    for trajectory in got:
        if trajectory.reward_source != "feedback":
            assert trajectory.reward == len(trajectory.token_ids) % 7 and trajectory.reward_source.endswith(
                "_async_reward"
            )  # type: ignore[union-attr]


def test_kill_9_at_random_points_yields_each_trajectory_exactly_once(tmp_path: Path) -> None:
    """Real processes: the assembler is killed with SIGKILL while events stream in, and restarted."""
    rng = random.Random(11)
    sessions = [_fake_session(f"crash{i}", rng.randint(1, 3), rng) for i in range(40)]
    expected = {
        t.trajectory_id for s in sessions for t in build_trajectories(SessionEvents.of(s), emitted_because="closed")
    }
    command = [sys.executable, "-m", "stream_stack", "assemble", "--ack-wait", "2", "--close-grace", "1"]
    with EmbeddedNatsServer() as server:
        command += ["--nats-url", server.url]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            chunks = [sessions[i : i + 8] for i in range(0, len(sessions), 8)]
            for n, chunk in enumerate(chunks):
                before = _delivered(server.url)
                anyio.run(_publish, server.url, tmp_path / f"outbox{n}", [e for s in chunk for e in s])
                # Kill it while it works: once it has taken some of this chunk, at a random moment.
                wait_for(lambda before=before: _delivered(server.url) > before, timeout=60)  # type: ignore[misc]
                time.sleep(rng.uniform(0.0, 0.15))
                process.send_signal(signal.SIGKILL)
                process.wait()
                process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            got = wait_for(
                lambda: (ts := read_trajectories(server.url)) and len(ts) >= len(expected) and ts, timeout=120
            )
            time.sleep(3)  # redeliveries after the last kill must not add anything
            got = read_trajectories(server.url)
        finally:
            process.kill()
            process.wait()
    ids = [t.trajectory_id for t in got]
    assert len(ids) == len(set(ids)), "a trajectory was published twice"
    assert set(ids) == expected, f"missing {len(expected - set(ids))}"


def _delivered(url: str) -> int:
    """The last stream sequence the assembler's durable consumer has handed out (0: none yet)."""

    async def fetch() -> int:
        nc = await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.2)
        try:
            info = await nc.jetstream().consumer_info("SG_EVENTS", "assembler")
            return int(info.delivered.stream_seq or 0) if info.delivered else 0
        except nats.js.errors.NotFoundError:
            return 0
        finally:
            await nc.close()

    return anyio.run(fetch)


def test_policy_and_closed_events_shape() -> None:
    events = _fake_session("shape", 2, random.Random(1))
    assert isinstance(events[-1], SessionClosed)
    assert [e.seq for e in events] == list(range(len(events)))
    assert sum(isinstance(e, TurnCompleted) for e in events) == 2


def test_pending_says_what_each_open_session_waits_for(tmp_path: Path) -> None:
    """``stream-gateway pending`` (issue 43): an open session is waiting for its close or its idle
    timeout, and the command says so, with the reward it gets without feedback."""
    rng = random.Random(5)
    waiting = [e for e in _fake_session("waiting1", 2, rng, close=False) if e.kind != "feedback.recorded"]
    with EmbeddedNatsServer() as server:
        anyio.run(_publish, server.url, tmp_path / "outbox", waiting)
        config = AssemblerConfig(servers=(server.url,), idle_timeout_s=600, default_reward=0.0)
        with background_assembler(config):
            wait_for(lambda: _pending_output(server.url).count("waiting1") == 1, timeout=30)
            said = _pending_output(server.url)
    assert "session waiting1: 2 turns, open, waiting for close, or 600 s without a request" in said, said
    assert "no feedback: reward 0" in said, said


def _pending_output(url: str) -> str:
    result = subprocess.run([sys.executable, "-m", "consumers.cli", "pending", "--nats-url", url, "--timeout", "1"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    return result.stdout
