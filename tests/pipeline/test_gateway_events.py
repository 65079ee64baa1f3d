"""The gateway's capture: real traffic through a real gateway into a real nats-server.

Every test reads what reached JetStream back with plain nats-py, decodes it with the pipeline's
models, and compares it with what the gateway served (``GET /sessions/{id}``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import nats
import pytest
from openai import OpenAI

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import Event, TurnCompleted, TurnDelta, TurnRecord, decode_event, full_prompt_ids, tenant_id
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import KEY, of_session, read_stream, wait_for
from ..support.servers import RunningGateway, run_gateway


def _client(gateway: RunningGateway, session_id: str, key: str = KEY) -> OpenAI:
    return OpenAI(base_url=f"{gateway.base_url}/sessions/{session_id}/v1", api_key=key, timeout=60, max_retries=0)


def _stream_turn(client: OpenAI, messages: list[dict[str, Any]], max_tokens: int = 12) -> dict[str, Any]:
    """One streamed turn; the assistant message exactly as received."""
    parts: list[str] = []
    finish = None
    with client.chat.completions.create(
        model="tiny",
        messages=messages,
        stream=True,
        max_tokens=max_tokens,
        seed=7,  # type: ignore[arg-type]
    ) as stream:
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length")  # the stream ended normally
    return {"role": "assistant", "content": "".join(parts)}


def _session_body(gateway: RunningGateway, session_id: str, key: str = KEY) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session_id}", headers={"authorization": f"Bearer {key}"})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _post(gateway: RunningGateway, path: str, body: Any = None, key: str = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    content = body if isinstance(body, str | bytes) else json.dumps(body if body is not None else {})
    return httpx.post(f"{gateway.base_url}{path}", content=content, headers=headers, timeout=30)


def test_a_conversation_produces_exactly_its_events_in_order(
    capture_gateway: RunningGateway, nats_server: EmbeddedNatsServer
) -> None:
    session_id = f"conv{secrets.token_hex(4)}"
    client = _client(capture_gateway, session_id)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about Paris."}]
    for question in ("And Berlin?", "And Tokyo?"):
        messages.append(_stream_turn(client, messages))
        messages.append({"role": "user", "content": question})
    messages.append(_stream_turn(client, messages))
    body = _session_body(capture_gateway, session_id)
    turns = body["turns"]
    assert [t["parent_id"] for t in turns] == [None, turns[0]["turn_id"], turns[1]["turn_id"]]
    assert _post(
        capture_gateway, f"/sessions/{session_id}/turns/{turns[1]['turn_id']}/feedback", {"score": 0.5}
    ).is_success
    assert _post(capture_gateway, f"/sessions/{session_id}/feedback", {"score": 1, "label": "good"}).is_success
    assert _post(capture_gateway, f"/sessions/{session_id}/close").json()["already_closed"] is False

    expected = ["session.opened"] + ["turn.started", "turn.completed"] * 3 + ["feedback.recorded"] * 2
    expected.append("session.closed")
    events = of_session(
        wait_for(nats_server.url, lambda es: any(e.kind == "session.closed" for e in of_session(es, session_id))),
        session_id,
    )
    assert [e.kind for e in events] == expected
    assert [e.seq for e in events] == list(range(len(expected)))  # in order, each once
    assert len({e.event_id for e in events}) == len(events)
    assert all(e.tenant == tenant_id(KEY) and KEY not in e.model_dump_json() for e in events)

    # The events rebuild the session token for token: prompts by reference to the parent turn.
    completed = [e for e in events if isinstance(e, TurnCompleted)]
    full: dict[str, list[int]] = {}
    for event, turn in zip(completed, turns, strict=True):
        assert (event.turn_id, event.parent_turn_id) == (turn["turn_id"], turn["parent_id"])
        parent = full.get(event.parent_turn_id) if event.parent_turn_id else None
        prompt = full_prompt_ids(event, parent)
        assert prompt == turn["prompt_ids"]
        assert event.output_ids == turn["output_ids"] and event.logprobs == turn["logprobs"]
        assert event.usage.prompt_tokens == len(prompt) and event.usage.completion_tokens == len(event.output_ids)
        full[event.turn_id] = prompt + event.output_ids
    assert completed[1].reused_prompt_tokens == len(full[completed[0].turn_id]) > 0
    assert len(completed[1].prompt_ids) < len(turns[1]["prompt_ids"])  # only the appended ids travel
    feedback = [e for e in events if e.kind == "feedback.recorded"]
    assert [(f.turn_id, f.score, f.label) for f in feedback] == [(turns[1]["turn_id"], 0.5, None), (None, 1.0, "good")]  # type: ignore[attr-defined]
    closed = events[-1]
    assert (closed.reason, closed.turns) == ("client", 3)  # type: ignore[attr-defined]
    subjects = {s for s, e in read_stream(nats_server.url) if e.session_id == session_id}
    assert f"sg.events.{tenant_id(KEY)}.{session_id}.turn.completed" in subjects


def test_feedback_and_close_validate_their_input(capture_gateway: RunningGateway) -> None:
    session_id = f"fb{secrets.token_hex(4)}"
    _stream_turn(_client(capture_gateway, session_id), [{"role": "user", "content": "hi"}])
    turn_id = _session_body(capture_gateway, session_id)["turns"][0]["turn_id"]
    path = f"/sessions/{session_id}/feedback"

    def error(response: httpx.Response, status: int) -> dict[str, Any]:
        assert response.status_code == status, response.text
        detail: dict[str, Any] = response.json()["error"]
        return detail

    assert error(_post(capture_gateway, "/sessions/nosuch/feedback", {"score": 1}), 404)["code"] == "session_not_found"
    # Another tenant's session id answers as one nobody used (issue 55).
    assert error(_post(capture_gateway, path, {"score": 1}, key="sk-other"), 404)["code"] == "session_not_found"
    for bad in ({"score": "1"}, {"score": True}, {}, {"score": 1, "extra": 2}, {"score": 1, "label": "x" * 300}):
        assert error(_post(capture_gateway, path, bad), 400)["param"] in {"score", "extra", "label"}
    assert error(_post(capture_gateway, path, "{not json"), 400)["type"] == "invalid_request_error"
    assert error(_post(capture_gateway, path, '{"score": NaN}'), 400)["type"] == "invalid_request_error"
    assert error(_post(capture_gateway, path, {"score": 1, "turn_id": "turnX"}), 404)["code"] == "turn_not_found"
    mismatch = _post(capture_gateway, f"/sessions/{session_id}/turns/{turn_id}/feedback", {"score": 1, "turn_id": "t2"})
    assert error(mismatch, 400)["param"] == "turn_id"
    assert error(_post(capture_gateway, f"/sessions/{session_id}/close", key="sk-other"), 404)  # as an unused id

    ok = _post(capture_gateway, path, {"score": -2.5, "turn_id": turn_id, "comment": "too short", "source": "judge"})
    assert ok.status_code == 200 and ok.json()["turn_id"] == turn_id
    assert _post(capture_gateway, f"/sessions/{session_id}/close").json() == {
        "id": session_id,
        "object": "session",
        "closed": True,
        "already_closed": False,
        "turns": 1,
    }
    assert _post(capture_gateway, f"/sessions/{session_id}/close").json()["already_closed"] is True
    # A closed session takes no more turns, but still takes feedback (rewards often come late).
    closed = _post(
        capture_gateway,
        f"/sessions/{session_id}/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert error(closed, 409)["code"] == "session_closed"
    assert _post(capture_gateway, path, {"score": 3}).status_code == 200
    body = _session_body(capture_gateway, session_id)
    assert body["closed"] is True and [f["score"] for f in body["feedback"]] == [-2.5, 3.0]


def test_live_deltas_are_coalesced_and_not_stored(
    capture_gateway: RunningGateway, nats_server: EmbeddedNatsServer
) -> None:
    session_id = f"live{secrets.token_hex(4)}"
    received: list[TurnDelta] = []

    async def run() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            sub = await nc.subscribe(f"sg.live.*.{session_id}.turn.delta")
            await nc.flush()
            client = OpenAI(base_url=f"{capture_gateway.base_url}/sessions/{session_id}/v1", api_key=KEY, max_retries=0)

            def stream() -> None:
                with client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "count"}],
                    stream=True,
                    max_tokens=40,
                    extra_body={"ignore_eos": True},
                ) as chunks:
                    for _ in chunks:
                        pass

            await anyio.to_thread.run_sync(stream)
            with anyio.move_on_after(10):
                while sum(len(d.token_ids) for d in received) < 40:
                    msg = await sub.next_msg(timeout=10)
                    event = decode_event(msg.data)
                    assert isinstance(event, TurnDelta)
                    received.append(event)
        finally:
            await nc.close()

    anyio.run(run)
    turn = _session_body(capture_gateway, session_id)["turns"][0]
    assert len(turn["output_ids"]) == 40
    # Once 8 tokens have gathered (the time trigger is set far off): contiguous, exactly the turn's
    # ids. An engine step can carry several tokens (steps that queued while the loop was busy are
    # handed over as one), so a delta holds 8 or a few more, and only the last may hold fewer.
    offsets = [d.offset for d in received]
    assert offsets[0] == 0
    assert offsets[1:] == [d.offset + len(d.token_ids) for d in received[:-1]]
    assert all(len(d.token_ids) >= 8 for d in received[:-1])
    assert 4 <= len(received) <= 5
    assert [i for d in received for i in d.token_ids] == turn["output_ids"]
    assert [p for d in received for p in d.logprobs] == turn["logprobs"]
    assert all(d.turn_id == turn["turn_id"] for d in received)
    stored = of_session([e for _, e in read_stream(nats_server.url)], session_id)
    assert stored and all(e.kind != "turn.delta" for e in stored)


def test_a_client_gone_mid_stream_is_recorded_as_aborted(
    capture_gateway: RunningGateway, nats_server: EmbeddedNatsServer
) -> None:
    session_id = f"gone{secrets.token_hex(4)}"
    client = _client(capture_gateway, session_id)
    with client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "go on forever"}],
        stream=True,
        max_tokens=2000,
        extra_body={"ignore_eos": True},
    ) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break  # leaving the block closes the connection
    events = of_session(
        wait_for(nats_server.url, lambda es: any(e.kind == "turn.aborted" for e in of_session(es, session_id))),
        session_id,
    )
    aborted = events[-1]
    assert isinstance(aborted, TurnRecord) and aborted.kind == "turn.aborted"
    assert aborted.reason == "client_disconnected"  # type: ignore[attr-defined]
    assert 0 < len(aborted.output_ids) < 2000 and len(aborted.logprobs) == len(aborted.output_ids)
    assert [e.kind for e in events] == ["session.opened", "turn.started", "turn.aborted"]


def _traffic(gateway: RunningGateway, sessions: list[str]) -> None:
    """One streamed turn in each session, every stream ending normally."""
    for session_id in sessions:
        _stream_turn(_client(gateway, session_id), [{"role": "user", "content": f"hello {session_id}"}])


def _assert_exactly_once(events: list[Event], sessions: list[str]) -> None:
    """Each session's durable events are all there, each once: seq 0, 1, 2 and distinct ids."""
    assert len({e.event_id for e in events}) == len(events), "a duplicate reached the stream"
    for session_id in sessions:
        mine = of_session(events, session_id)
        assert sorted(e.seq for e in mine) == [0, 1, 2], (session_id, [(e.seq, e.kind) for e in mine])
        assert sorted(e.kind for e in mine) == ["session.opened", "turn.completed", "turn.started"]


@pytest.mark.parametrize("fault", ["killed", "paused"])
def test_nats_failing_mid_traffic_loses_nothing(
    fault: str, capture_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    with EmbeddedNatsServer() as server:
        settings = capture_settings(server.url)
        with run_gateway(build_engine(settings), settings) as gateway:
            before = [f"pre{i}{secrets.token_hex(3)}" for i in range(2)]
            during = [f"{fault}{i}{secrets.token_hex(3)}" for i in range(4)]
            _traffic(gateway, before)
            if fault == "killed":
                server.kill()
            else:
                server.pause()
            try:
                _traffic(gateway, during)  # every stream completes while NATS is away
                metrics = httpx.get(f"{gateway.base_url}/metrics").text
                assert "gateway_events_pending" in metrics
            finally:
                if fault == "killed":
                    server.restart()
                else:
                    server.resume()
            events = wait_for(
                server.url, lambda es: all(len(of_session(es, s)) >= 3 for s in before + during), timeout=90
            )
            _assert_exactly_once(events, before + during)


def test_a_restarted_gateway_replays_its_outbox(capture_settings: Callable[..., Settings], tmp_path: Path) -> None:
    outbox = tmp_path / "outbox"
    with EmbeddedNatsServer() as server:
        # A lone gateway asked to close its sessions when it stops: the closes go to the outbox too.
        settings = capture_settings(server.url, close_sessions_on_shutdown=True)
        sessions = [f"outbox{i}{secrets.token_hex(3)}" for i in range(3)]
        with run_gateway(build_engine(settings), settings) as gateway:
            _traffic(gateway, sessions[:1])
            server.kill()
            _traffic(gateway, sessions[1:])
        # The gateway stopped with NATS away: what it could not publish is on disk.
        assert any(p.stat().st_size for p in outbox.glob("*.seg"))
        server.restart()
        with run_gateway(build_engine(settings), settings):
            events = wait_for(server.url, lambda es: all(len(of_session(es, s)) >= 4 for s in sessions), timeout=90)
        # 3 per session from the traffic, then session.closed (shutdown) from the first gateway.
        assert len({e.event_id for e in events}) == len(events)
        for session_id in sessions:
            kinds = [e.kind for e in sorted(of_session(events, session_id), key=lambda e: e.seq)]
            assert kinds == ["session.opened", "turn.started", "turn.completed", "session.closed"]
        assert not list(outbox.glob("*.seg")) or all(p.stat().st_size == 0 for p in outbox.glob("*.seg"))


def test_a_prompt_far_over_one_megabyte_gets_through(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    settings = Settings(
        model=str(tiny_model_path),
        engine="synthetic",
        served_model_name="tiny",
        max_model_len=2_000_000,
        nats_url=nats_server.url,
        outbox_dir=tmp_path / "outbox",
    )
    words = ["river", "stone", "lamp", "garden", "window", "cloud", "seven", "orange", "quiet", "market"]
    rng = secrets.SystemRandom()
    content = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(200_000))
    session_id = f"big{secrets.token_hex(4)}"
    with run_gateway(build_engine(settings), settings) as gateway:
        client = OpenAI(
            base_url=f"{gateway.base_url}/sessions/{session_id}/v1", api_key=KEY, max_retries=0, timeout=120
        )
        _stream_turn(client, [{"role": "user", "content": content}], max_tokens=5)
        prompt = _session_body(gateway, session_id)["turns"][0]["prompt_ids"]
        events = wait_for(
            nats_server.url, lambda es: any(e.kind == "turn.completed" for e in of_session(es, session_id)), timeout=120
        )
    completed = next(e for e in of_session(events, session_id) if isinstance(e, TurnCompleted))
    assert len(json.dumps(completed.prompt_ids)) > 2 * 1024 * 1024  # far over the 1 MiB max payload
    assert completed.prompt_ids == prompt and completed.reused_prompt_tokens == 0


def test_new_weights_through_the_gateway_bump_the_policy_and_are_announced(
    nats_server: EmbeddedNatsServer, capture_settings: Callable[..., Settings], tiny_model_path: Path, tmp_path: Path
) -> None:
    """``POST /policy/weights`` (admin key only): the engine samples from the new weights, turns
    record the new version, and ``policy.applied`` names the checkpoint and this replica."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    weights = tmp_path / "step-1"
    weights.mkdir()
    state = {k: v * 1.5 if "norm" in k else v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(weights / "model.safetensors"))

    settings = capture_settings(nats_server.url, admin_api_keys=("sk-admin",))
    with run_gateway(build_engine(settings), settings) as gateway:
        session_id = f"pol{secrets.token_hex(4)}"
        client = _client(gateway, session_id)
        before = _stream_turn(client, [{"role": "user", "content": "hi"}])
        body = {"path": str(weights), "policy_version": 1}
        assert _post(gateway, "/policy/weights", body).status_code == 403  # not an admin key
        missing = body | {"path": str(tmp_path / "nope")}
        assert _post(gateway, "/policy/weights", missing, key="sk-admin").status_code == 400
        ok = _post(gateway, "/policy/weights", body, key="sk-admin")
        assert ok.status_code == 200, ok.text
        answer = ok.json()
        assert answer.pop("pause_s") >= answer.pop("copy_s") > 0
        assert answer == {
            "object": "policy",
            "policy_version": 1,
            "previous_version": 0,
            "weights": str(weights),
            "replica": gateway.health()["replica"],
        }
        assert _post(gateway, "/policy/weights", body, key="sk-admin").json()["error"]["code"] == "stale_policy_version"
        assert gateway.health()["policy_version"] == 1
        _stream_turn(client, [{"role": "user", "content": "hi"}, before, {"role": "user", "content": "again"}])
        turns = _session_body(gateway, session_id)["turns"]
        assert [t["policy_version"] for t in turns] == [0, 1]
        replica = gateway.health()["replica"]
        events = wait_for(
            nats_server.url,
            lambda es: any(e.kind == "policy.applied" and getattr(e, "replica", None) == replica for e in es),
        )
    [update] = [e for e in events if e.kind == "policy.applied" and getattr(e, "replica", None) == replica]
    assert (update.policy_version, update.previous_version, update.source) == (1, 0, str(weights))  # type: ignore[attr-defined]
    rejected = [e for e in events if e.kind == "policy.rejected" and getattr(e, "replica", None) == replica]
    assert [e.reason for e in rejected] == ["not_newer"]  # type: ignore[attr-defined]
    # The second turn was sampled from the new weights: a forward pass of them reproduces its logprobs.
    model.load_state_dict(state, strict=False)
    second = turns[1]
    ids = torch.tensor([second["prompt_ids"] + second["output_ids"]])
    logits = model(ids).logits[0, len(second["prompt_ids"]) - 1 : -1]
    recomputed = torch.log_softmax(logits, -1).gather(1, torch.tensor(second["output_ids"])[:, None])[:, 0]
    torch.testing.assert_close(recomputed, torch.tensor(second["logprobs"]), atol=2e-4, rtol=0)
