"""Routed experts through NATS: each ``turn.completed`` carries only the rows its turn ran first,
events over the server's max payload go through the object store, another replica continuing a
conversation gets the earlier rows from the stream, and NATS being away loses none of them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from openai import OpenAI

from pipeline.connection import connect
from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig
from pipeline.events import Event, TurnCompleted
from pipeline.streams import PAYLOAD_OBJECT_HEADER
from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.moe import decode_routes

from ..support.capture import KEY, of_session, replica_settings, wait_for
from ..support.servers import RunningGateway, run_gateway

MODEL = "tiny-moe"
# A long first message: the root turn's routes (~10,000 positions x 3 layers x top-2) are ~80 KB
# of base64, over the 64 KiB max payload below, so that event goes through the object store.
LONG = " ".join(f"line {i}: the lighthouse keeper counts the ships." for i in range(700))


@pytest.fixture
def moe_settings(tmp_path: Path) -> Callable[..., Settings]:
    return replica_settings(MODEL, tmp_path)


def _turn(gateway: RunningGateway, session: str, messages: list[dict[str, Any]], max_tokens: int = 24) -> None:
    """One turn; appends the assistant message as received."""
    with OpenAI(base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key=KEY, max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)  # type: ignore[arg-type]
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def _body(gateway: RunningGateway, session: str) -> dict[str, Any]:
    response = httpx.get(
        f"{gateway.base_url}/sessions/{session}",
        params={"include": "routed_experts"},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _completed(events: list[Event], session: str, count: int) -> list[TurnCompleted]:
    done = [e for e in of_session(events, session) if isinstance(e, TurnCompleted)]
    assert len(done) == count, [e.kind for e in of_session(events, session)]
    return sorted(done, key=lambda e: e.started_at)  # replicas number their events in blocks of their own


def _object_pointers(url: str) -> int:
    """How many messages of the events stream stand in for an event kept in the object store."""

    async def count() -> int:
        nc = await connect(url, None)
        try:
            js = nc.jetstream()
            info = await js.stream_info("SG_EVENTS")
            found = 0
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg("SG_EVENTS", seq)
                found += PAYLOAD_OBJECT_HEADER in (msg.headers or {})
            return found
        finally:
            await nc.close()

    return anyio.run(count)


def test_events_carry_new_rows_and_a_replica_continues_with_the_earlier_ones(
    moe_settings: Callable[..., Settings],
) -> None:
    with EmbeddedNatsServer(NatsServerConfig(max_payload=64 * 1024)) as server:
        first, second = moe_settings(server.url, "a"), moe_settings(server.url, "b")
        session = f"moe{secrets.token_hex(4)}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": LONG}]
        with run_gateway(build_engine(first), first) as a, run_gateway(build_engine(second), second) as b:
            _turn(a, session, messages)
            messages.append({"role": "user", "content": "And then?"})
            _turn(b, session, messages)  # another replica continues: it reads turn 1 from the stream
            messages.append({"role": "user", "content": "Why?"})
            _turn(a, session, messages)
            on_b = _body(b, session)
            events = wait_for(server.url, lambda es: len(_completed_or_none(es, session)) >= 3, timeout=60)
        pointers = _object_pointers(server.url)
    turns = _completed(events, session, 3)
    assert [t.parent_turn_id for t in turns] == [None, turns[0].turn_id, turns[1].turn_id]
    rows = []
    for turn in turns:
        routes = turn.routed_experts
        assert routes is not None
        # Only what this turn ran first: from its parent's last output token to its own last-but-one.
        assert routes.start == max(turn.reused_prompt_tokens - 1, 0)
        assert (
            routes.start + routes.shape[0]
            == turn.reused_prompt_tokens + len(turn.prompt_ids) + len(turn.output_ids) - 1
        )
        rows.append(decode_routes(routes.model_dump(include={"shape", "dtype", "data"})))
    assert rows[0].nbytes * 4 / 3 > 64 * 1024 and pointers >= 1
    # Replica b's view of the session: the chain's routes, turn 1's rows taken from a's event.
    [chain] = on_b["chains"]
    assert np.array_equal(decode_routes(chain["routed_experts"]), np.concatenate(rows))
    by_id = {t["turn_id"]: t for t in on_b["turns"]}
    second_turn = by_id[turns[1].turn_id]
    assert (
        decode_routes(second_turn["routed_experts"]).shape[0]
        == len(second_turn["prompt_ids"]) + len(second_turn["output_ids"]) - 1
    )


def _completed_or_none(events: list[Event], session: str) -> list[Event]:
    return [e for e in of_session(events, session) if isinstance(e, TurnCompleted)]


def test_routes_wait_in_the_outbox_while_nats_is_away(moe_settings: Callable[..., Settings]) -> None:
    with EmbeddedNatsServer() as server:
        settings = moe_settings(server.url)
        session = f"away{secrets.token_hex(4)}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        with run_gateway(build_engine(settings), settings) as gateway:
            server.kill()
            try:
                for question in ("more", "again"):
                    _turn(gateway, session, messages)
                    messages.append({"role": "user", "content": question})
                served = _body(gateway, session)
            finally:
                server.restart()
            events = wait_for(server.url, lambda es: len(_completed_or_none(es, session)) >= 2, timeout=90)
    turns = _completed(events, session, 2)
    rebuilt = np.concatenate([decode_routes(t.routed_experts.model_dump(exclude={"start"})) for t in turns])  # type: ignore[union-attr]
    assert np.array_equal(rebuilt, decode_routes(served["chains"][0]["routed_experts"]))
