"""Gateway replicas sharing sessions through one NATS server: real processes, real sockets.

Two ``stream-gateway serve --model tiny --engine scripted --served-model-name tiny-agent --nats-url
...`` processes (the untrained tiny model answering by the scripted engine's default script: a
``read`` call after a user message when the tool is offered, "Done: I read the file." after its
result, "Hello from tiny-agent." otherwise; each process holds its own copy of the model) and the
official ``openai`` client whose requests a round-robin transport sends to one replica, then the
other, like a load balancer without affinity. A conversation must come out as one token-exact
chain however its turns were spread (a forward pass of the same untrained model reproduces every
recorded logprob); a replica killed between turns loses nothing; concurrent turns on one parent
become siblings; tenants stay apart; with NATS paused, requests are still served (falling back)
and the fallback is recorded.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.models import AGENT_AFTER_TOOL, AGENT_WITHOUT_TOOLS

from ..support.agent_loop import READ_TOOL, drive_session
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import free_port, wait_healthy

KEY = "sk-tenant-a"
OTHER = "sk-tenant-b"


class Replica:
    """One gateway process on its own port, capturing to the shared NATS server."""

    def __init__(self, name: str, model: Path, nats_url: str, workdir: Path) -> None:
        self.name = name
        self.model, self.nats_url = model, nats_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        self.outbox = workdir / f"outbox-{name}"
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--model", str(self.model),
                   "--engine", "scripted", "--served-model-name", "tiny-agent",
                   "--port", str(self.port), "--log-level", "warning",
                   "--nats-url", self.nats_url, "--outbox-dir", str(self.outbox),
                   "--session-sync-timeout-seconds", "0.5", "--replica-id", self.name]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
        with self.log.open("a") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
        wait_healthy(self.process, self.port, log=self.log)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)

    def session(self, session_id: str, key: str = KEY) -> httpx.Response:
        return httpx.get(f"{self.url}/sessions/{session_id}", headers={"authorization": f"Bearer {key}"}, timeout=30)


class RoundRobin(httpx.BaseTransport):
    """Sends each request to the next replica in turn (a load balancer without affinity)."""

    def __init__(self, replicas: list[Replica]) -> None:
        self._ports = itertools.cycle([r.port for r in replicas])
        self._inner = httpx.HTTPTransport()  # closed with the client that owns this transport
        self._lock = threading.Lock()
        self.served: list[int] = []  # the port of each request, in order
        self.session_ids: list[str] = []  # x-session-id of each response

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            port = next(self._ports)
        self.served.append(port)
        request.url = request.url.copy_with(port=port)
        response = self._inner.handle_request(request)
        if "x-session-id" in response.headers:
            self.session_ids.append(response.headers["x-session-id"])
        return response

    def close(self) -> None:  # a client using it was closed; a later client gets fresh connections
        self._inner.close()
        self._inner = httpx.HTTPTransport()


def _client(transport: httpx.BaseTransport, session_id: str | None = None, key: str = KEY) -> OpenAI:
    base = "http://127.0.0.1:1" + (f"/sessions/{session_id}/v1" if session_id else "/v1")
    return OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60, http_client=httpx.Client(transport=transport))


def _chat(transport: httpx.BaseTransport, session_id: str | None = None, key: str = KEY, **body: Any) -> Any:
    """One non-streamed chat completion through ``transport``."""
    with _client(transport, session_id, key) as client:
        return client.chat.completions.create(**body)


@pytest.fixture(scope="module")
def shared_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer() as server:
        yield server


@pytest.fixture(scope="module")
def replicas(
    agent_model_path: Path, shared_nats: EmbeddedNatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    workdir = tmp_path_factory.mktemp("replicas")
    pair = [Replica(name, agent_model_path, shared_nats.url, workdir) for name in ("replica-a", "replica-b")]
    try:
        for replica in pair:
            replica.start()
        yield pair
    finally:
        for replica in pair:
            replica.stop()


@pytest.fixture(scope="module")
def reference_model(agent_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()


def _assert_one_exact_chain(session: dict[str, Any], reference_model: Any, finishes: list[str]) -> None:
    turns = session["turns"]
    assert [t["finish_reason"] for t in turns] == finishes, turns
    # One chain: each turn continues the one before, reusing its prompt and sampled ids (T2) ...
    assert [t["parent_id"] for t in turns[1:]] == [t["turn_id"] for t in turns[:-1]]
    assert all(t["reused_prompt_tokens"] == len(p["prompt_ids"]) + len(p["output_ids"])
               for p, t in itertools.pairwise(turns))  # fmt: skip
    assert all(t["prompt_ids"][: t["reused_prompt_tokens"]] == p["prompt_ids"] + p["output_ids"]
               for p, t in itertools.pairwise(turns))  # fmt: skip
    # ... and each prompt equals a fresh render of the whole conversation (T3).
    assert all(t["matches_full_render"] and t["fallback_reason"] is None for t in turns), turns
    (chain,) = session["chains"]
    assert_chain_logprobs(reference_model, chain["token_ids"], chain["mask"], chain["logprobs"])


def _turns_in_order(session: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns of a one-chain session from root to leaf (replicas may list them in any order)."""
    by_parent = {t["parent_id"]: t for t in session["turns"]}
    ordered, parent = [], None
    while parent in by_parent:
        ordered.append(by_parent[parent])
        parent = ordered[-1]["turn_id"]
    return ordered


@pytest.mark.parametrize("named", [False, True], ids=["automatic", "named"])
def test_a_tool_loop_alternating_between_replicas_is_one_token_exact_chain(
    replicas: list[Replica], reference_model: Any, tmp_path: Path, named: bool
) -> None:
    (tmp_path / "README.md").write_text("The project streams tokens.\n")
    transport = RoundRobin(replicas)
    session_id = f"alt{secrets.token_hex(4)}" if named else None
    with _client(transport, session_id) as client:
        messages = drive_session(
            client,
            "tiny-agent",
            [{"role": "user", "content": "What does the README say?"}],
            follow_ups=["Thanks. And again?", "Once more, please."],
            workdir=tmp_path,
            tools=[READ_TOOL],
            temperature=1.0,
            seed=5,
            max_tokens=48,
        )
    # Each user message: a ``read`` call, then the answer after its result; three times.
    said = [(m["content"], [c["function"]["name"] for c in m.get("tool_calls") or []])
            for m in messages if m["role"] == "assistant"]  # fmt: skip
    assert said == [(None, ["read"]), (AGENT_AFTER_TOOL, [])] * 3, said
    # Every other request went to the other replica, and every response named one session.
    assert transport.served == [r.port for r in replicas] * 3
    assert len(set(transport.session_ids)) == 1, transport.session_ids
    found = transport.session_ids[0]
    if session_id is not None:
        assert found == session_id
    views = [r.session(found).json() for r in replicas]
    for view in views:
        view["turns"] = _turns_in_order(view)
        _assert_one_exact_chain(view, reference_model, ["tool_calls", "stop"] * 3)
    # Both replicas tell the same story.
    assert [t["turn_id"] for t in views[0]["turns"]] == [t["turn_id"] for t in views[1]["turns"]]
    assert views[0]["chains"][0]["token_ids"] == views[1]["chains"][0]["token_ids"]


def test_a_conversation_continues_token_exactly_after_its_replica_is_killed(
    replicas: list[Replica], reference_model: Any
) -> None:
    first, second = replicas
    session_id = f"kill{secrets.token_hex(4)}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
    answer = _chat(
        _Fixed(first), session_id, model="tiny-agent", messages=messages, max_tokens=16, temperature=1.0, seed=3
    )
    assert answer.choices[0].message.content == AGENT_WITHOUT_TOOLS
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "And more?"}]  # fmt: skip
    first.kill()  # between turns: whatever it held in memory is gone
    try:
        _chat(_Fixed(second), session_id, model="tiny-agent", messages=messages, max_tokens=16, temperature=1.0, seed=4)
        session = second.session(session_id).json()
        session["turns"] = _turns_in_order(session)
        _assert_one_exact_chain(session, reference_model, ["stop", "stop"])
    finally:
        first.start()
    # The restarted replica knows the session too (it never saw it before).
    assert [t["turn_id"] for t in _turns_in_order(first.session(session_id).json())] == [
        t["turn_id"] for t in session["turns"]
    ]


class _Fixed(httpx.HTTPTransport):
    """Every request to one replica."""

    def __init__(self, replica: Replica) -> None:
        super().__init__()
        self._port = replica.port

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=self._port)
        return super().handle_request(request)


def test_two_replicas_extending_one_turn_at_once_make_two_siblings(replicas: list[Replica]) -> None:
    session_id = f"fork{secrets.token_hex(4)}"
    base: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
    root = _chat(
        _Fixed(replicas[0]), session_id, model="tiny-agent", messages=base, max_tokens=12, temperature=1.0, seed=1
    )
    history = [*base, {"role": "assistant", "content": root.choices[0].message.content}]

    def extend(i: int) -> str:
        follow = [*history, {"role": "user", "content": f"Branch {i}."}]
        reply = _chat(
            _Fixed(replicas[i]),
            session_id,
            model="tiny-agent",
            messages=follow,
            max_tokens=12,
            temperature=1.0,
            seed=10 + i,
        )
        return reply.id

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(extend, range(2)))
    for replica in replicas:
        turns = replica.session(session_id).json()["turns"]
        (root_turn,) = [t for t in turns if t["parent_id"] is None]
        children = [t for t in turns if t["parent_id"] == root_turn["turn_id"]]
        assert len(turns) == 3 and len(children) == 2, turns
        reused = len(root_turn["prompt_ids"]) + len(root_turn["output_ids"])
        assert all(c["reused_prompt_tokens"] == reused for c in children)
        assert len(replica.session(session_id).json()["chains"]) == 2


def test_one_tenant_cannot_reach_anothers_session_on_any_replica(replicas: list[Replica]) -> None:
    session_id = f"mine{secrets.token_hex(4)}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Private."}]
    answer = _chat(
        _Fixed(replicas[0]), session_id, model="tiny-agent", messages=messages, max_tokens=8, temperature=0.0
    )
    for replica in replicas:
        assert replica.session(session_id).status_code == 200
        # A session id is its tenant's name: to another key it is one nobody used.
        denied = replica.session(session_id, key=OTHER)
        unused = replica.session(f"{session_id}-unused", key=OTHER)
        assert denied.status_code == unused.status_code == 404, denied.text
        assert denied.json()["error"]["code"] == unused.json()["error"]["code"]
    # The other key's request under the same name starts a session of its own, on either replica.
    post = httpx.post(f"{replicas[1].url}/sessions/{session_id}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {OTHER}"},
                      json={"model": "tiny-agent", "messages": messages, "max_tokens": 4})  # fmt: skip
    assert post.status_code == 200, post.text
    for replica in replicas:
        ours, theirs_view = replica.session(session_id).json(), replica.session(session_id, key=OTHER).json()
        assert len(ours["turns"]) == len(theirs_view["turns"]) == 1
        assert ours["turns"][0]["turn_id"] != theirs_view["turns"][0]["turn_id"]
    # Automatic detection does not cross tenants either: the other key's identical conversation is its own.
    follow = [*messages, {"role": "assistant", "content": answer.choices[0].message.content},
              {"role": "user", "content": "More."}]  # fmt: skip
    transport = RoundRobin(replicas)
    _chat(transport, key=OTHER, model="tiny-agent", messages=follow, max_tokens=4, temperature=0.0)
    (theirs,) = transport.session_ids
    assert theirs != session_id
    assert replicas[0].session(theirs, key=OTHER).json()["turns"][0]["parent_id"] is None


def test_close_and_feedback_work_on_any_replica(replicas: list[Replica]) -> None:
    session_id = f"close{secrets.token_hex(4)}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello."}]
    _chat(_Fixed(replicas[0]), session_id, model="tiny-agent", messages=messages, max_tokens=6, temperature=0.0)
    headers = {"authorization": f"Bearer {KEY}"}
    turn_id = replicas[1].session(session_id).json()["turns"][0]["turn_id"]
    feedback = httpx.post(f"{replicas[1].url}/sessions/{session_id}/turns/{turn_id}/feedback", headers=headers,
                          json={"score": 1.5}, timeout=30)  # fmt: skip
    assert feedback.status_code == 200, feedback.text
    closed = httpx.post(f"{replicas[1].url}/sessions/{session_id}/close", headers=headers, timeout=30).json()
    assert closed["closed"] and not closed["already_closed"] and closed["turns"] == 1
    view = replicas[0].session(session_id).json()
    assert view["closed"] and [f["score"] for f in view["feedback"]] == [1.5]
    refused = httpx.post(f"{replicas[0].url}/sessions/{session_id}/v1/chat/completions", headers=headers,
                         json={"model": "tiny-agent", "messages": messages, "max_tokens": 4}, timeout=30)  # fmt: skip
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_closed"


def test_with_nats_paused_both_replicas_serve_and_record_the_fallback(
    replicas: list[Replica], shared_nats: EmbeddedNatsServer
) -> None:
    # Turn 1 of each conversation on replica A while NATS is up.
    conversations = []
    for i in range(2):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Topic {i}."}]
        first = _chat(_Fixed(replicas[0]), model="tiny-agent", messages=messages, max_tokens=16, temperature=0.0)
        conversations.append([*messages, {"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "user", "content": "Go on."}])  # fmt: skip
    shared_nats.pause()
    try:
        # Turn 2 of each on replica B, which cannot ask NATS: served anyway, as new roots.
        transport = RoundRobin([replicas[1]])
        for messages in conversations:
            reply = _chat(transport, model="tiny-agent", messages=messages, max_tokens=16, temperature=0.0)
            assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (AGENT_WITHOUT_TOOLS, "stop")
        # Replica A still continues its own conversation from its cache.
        cached = RoundRobin([replicas[0]])
        _chat(cached, model="tiny-agent", messages=conversations[0], max_tokens=16, temperature=0.0)
    finally:
        shared_nats.resume()
    fallback = replicas[1].session(transport.session_ids[0]).json()["turns"]
    assert fallback[0]["parent_id"] is None and "unreachable" in (fallback[0]["fallback_reason"] or ""), fallback
    continued = replicas[0].session(cached.session_ids[0]).json()["turns"]
    assert any(t["parent_id"] is not None and t["fallback_reason"] is None for t in continued), continued
