"""Reading another replica's turns back from a real events stream (``TurnReplay``).

A turn's event reaches the stream before the session record names the turn, so a read for the
turns the record names meets the next turn's event first. That event must still be there when
the record names its turn: once it was dropped while the read's cursor moved past it, and the
turn could not be read back until the session left the cache (a cluster's rolling restart: a
conversation waited 35 s and started a new root).
"""

from __future__ import annotations

import secrets

import anyio
import httpx

from pipeline.connection import connect
from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.sessions import Session, SessionStore
from stream_gateway.sessions._replay import ReplayCursor, TurnReplay

from ..support.capture import KEY, of_session, wait_for
from ..support.servers import RunningGateway


def test_a_turn_read_before_the_record_names_it_is_found_when_it_does(
    capture_gateway: RunningGateway, nats_server: EmbeddedNatsServer
) -> None:
    session_id = f"replay{secrets.token_hex(4)}"
    url = f"{capture_gateway.base_url}/sessions/{session_id}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(2):  # two turns, the second continuing the first
        reply = httpx.post(url, json={"model": "tiny", "messages": messages, "max_tokens": 3},
                           headers={"authorization": f"Bearer {KEY}"}, timeout=60).json()  # fmt: skip
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "more"}]
    wait_for(nats_server.url, lambda es: sum(e.kind == "turn.completed" for e in of_session(es, session_id)) == 2)
    served = httpx.get(f"{capture_gateway.base_url}/sessions/{session_id}", headers={"authorization": f"Bearer {KEY}"})
    first, second = (t["turn_id"] for t in served.json()["turns"])

    async def read_back() -> tuple[list[str], list[str]]:
        store = SessionStore()
        session = store.insert(Session(session_id, KEY, 0.0, 0.0))
        replay = TurnReplay(store, stream="SG_EVENTS", subject_prefix="sg", timeout_s=1.0)
        cursor = ReplayCursor()
        nc = await connect(nats_server.url, None)
        try:
            js = nc.jetstream()
            # The record names the first turn only; the read meets both events.
            await replay.read_turns(js, session, cursor, {first}, {})
            after_first = list(session.turns)
            await replay.read_turns(js, session, cursor, {second}, {})  # now the record names the second
            return after_first, list(session.turns)
        finally:
            await nc.close()

    after_first, after_second = anyio.run(read_back)
    assert after_first == [first]
    assert after_second == [first, second]
