"""Gateway replicas on a three-node JetStream cluster: a NATS node dies, conversations go on.

Three clustered ``nats-server`` processes (:class:`~pipeline.embedded.EmbeddedNatsCluster`), the
events stream, the sessions bucket and the object stores replicated three times
(``--stream-replicas 3``), and two gateway replicas (synthetic engine, the tiny model's tokenizer)
whose NATS URL names all three servers. A conversation's first turn goes to one replica; a node is
SIGKILLed (the events stream's leader, the sessions bucket's leader, or a node leading neither,
in turn); the second turn goes at once to the other replica, which must continue the chain with
the prefix reused: waiting, within ``--session-handoff-seconds``, for what the cluster cannot
answer during its election instead of starting a new root.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from pipeline.embedded import EmbeddedNatsCluster
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, run_gateway

KILLS = 6  # each kind of node twice: 12 conversations move (10 kills: 20 of 20 continued; 2 of 20 before)
KEY = "sk-cluster"
AUTH = {"authorization": f"Bearer {KEY}"}
SESSIONS_STREAM = "KV_sg_sessions"
EVENTS_STREAM = "SG_EVENTS"


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedNatsCluster]:
    with EmbeddedNatsCluster(3) as nats:
        yield nats


@pytest.fixture(scope="module")
def replicas(
    cluster: EmbeddedNatsCluster, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunningGateway]]:
    work = tmp_path_factory.mktemp("cluster")
    with ExitStack() as stack:
        running = []
        for name in ("r1", "r2"):
            settings = Settings(
                model=str(tiny_model_path),
                served_model_name="tiny",
                engine="synthetic",
                nats_url=cluster.url,
                stream_replicas=3,
                outbox_dir=work / f"outbox-{name}",
                replica_id=name,
                synthetic_tokens_per_second=40,  # 8 tokens in 0.2 s: a node can die mid-stream
            )
            running.append(stack.enter_context(run_gateway(build_engine(settings), settings)))
        yield running


def _turn(
    replica: RunningGateway, messages: list[dict[str, Any]], started: threading.Event | None = None
) -> tuple[str, str]:
    """One streamed turn on ``replica``: its text and the session it joined (``x-session-id``);
    ``started`` is set at its first chunk."""
    client = OpenAI(base_url=replica.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 8, "stream": True, "temperature": 0}
    parts: list[str] = []
    with client, client.chat.completions.with_streaming_response.create(**body) as response:
        session_id = response.headers["x-session-id"]
        for chunk in response.parse():
            if started is not None:
                started.set()
            parts.extend(choice.delta.content or "" for choice in chunk.choices)
    return "".join(parts), session_id


def _turns(replica: RunningGateway, session_id: str) -> list[dict[str, Any]]:
    """The session's turns as ``replica`` sees them, oldest first."""
    response = httpx.get(f"{replica.base_url}/sessions/{session_id}", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    turns: list[dict[str, Any]] = response.json()["turns"]
    return sorted(turns, key=lambda t: t["created_at"])


def _victims(cluster: EmbeddedNatsCluster) -> Iterator[tuple[str, int]]:
    """Which node to kill next: the events stream's leader, the sessions bucket's, one leading neither."""
    for what in itertools.cycle(("events leader", "sessions leader", "follower")):
        events, sessions = cluster.leader(EVENTS_STREAM), cluster.leader(SESSIONS_STREAM)
        assert events is not None and sessions is not None, "the cluster has no leader before the kill"
        if what == "events leader":
            yield what, events
        elif what == "sessions leader":
            yield what, sessions
        else:
            yield what, next(i for i in range(3) if i not in (events, sessions))


def test_conversations_move_to_another_replica_right_after_a_nats_node_is_killed(
    cluster: EmbeddedNatsCluster, replicas: list[RunningGateway]
) -> None:
    first, second = replicas
    _turn(first, [{"role": "user", "content": "warm up"}])  # the streams and buckets exist (replicated)
    outcomes: list[tuple[int, str, str, str | None, int]] = []  # kill, which node, which conversation, ...
    longest = 0.0
    victims = _victims(cluster)
    with ThreadPoolExecutor(2) as pool:
        for kill in range(KILLS):
            what, victim = next(victims)
            # One conversation whose first turn ended before the kill, one whose first turn streams
            # through it (its entry is stored during the election: its end waits for that).
            before = [{"role": "user", "content": f"kill {kill}: before"}]
            during = [{"role": "user", "content": f"kill {kill}: during"}]
            first_before = _turn(first, before)
            streaming = threading.Event()
            first_during = pool.submit(_turn, first, during, streaming)
            assert streaming.wait(60), "the first turn did not start"
            cluster.kill(victim)
            try:
                started = time.monotonic()
                firsts = [("before", before, first_before), ("during", during, first_during.result())]
                seconds = []
                for _, messages, (text, _) in firsts:
                    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
                    seconds.append(pool.submit(_turn, second, messages))
                continued_in = [future.result()[1] for future in seconds]
                longest = max(longest, time.monotonic() - started)
                new_turns = [_turns(second, session)[-1] for session in continued_in]
            finally:
                cluster.restart(victim)
            for (which, _, (_, session_id)), moved_to, new_turn in zip(firsts, continued_in, new_turns, strict=True):
                first_turns = [t["turn_id"] for t in _turns(first, session_id)]
                continued = moved_to == session_id and new_turn["parent_id"] in first_turns
                reason = None if continued else f"new root in {moved_to}: {new_turn['fallback_reason']}"
                outcomes.append((kill, what, which, reason, new_turn["reused_prompt_tokens"]))
    print(f"{len(outcomes)} conversations moved after {KILLS} node kills; longest second turn {longest:.1f} s")
    broken = [o for o in outcomes if o[3] is not None]
    assert not broken, f"{len(broken)} of {len(outcomes)} conversations lost their chain: {broken}"
    assert all(o[4] > 0 for o in outcomes), outcomes  # the prefix was reused, not re-rendered
