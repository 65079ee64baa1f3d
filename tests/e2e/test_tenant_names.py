"""Names a client chooses are its tenant's: two tenants on two replicas, one NATS, the same names.

Two gateway replicas (the scripted engine on ``tiny``, so answers are known) share one nats-server
and its sessions bucket; two API keys are two tenants (without ``--api-key-file`` each bearer key is
a tenant of its own). Both use the session id ``run-1`` on chat completions, Messages, Responses and
token-in, alternating replicas: each continues its own conversation token-exactly, reads only its
own, and a third tenant's reading, feedback and close of ``run-1`` answer exactly as for an id nobody
used. A session stored in the layout before tenants named sessions (``s.<session>``, record version
1) continues on a replica of this version. GRPO group labels are scoped the same way.
"""

from __future__ import annotations

import itertools
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import nats
import orjson
import pytest
from openai import OpenAI

from consumers.verl_batch import group_uid
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import tenant_id
from stream_gateway.engines import build_engine
from stream_gateway.sessions import record_key

from ..support.servers import RunningGateway, run_gateway, scripted_settings
from ..support.trajectories import make_trajectory

ALICE, BOB, EVE = "sk-alice", "sk-bob", "sk-eve"
BUCKET = "sg_sessions"


@pytest.fixture(scope="module")
def shared_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer() as server:
        yield server


def _replica(model: Path, nats_url: str, name: str, tmp: Path) -> Any:
    settings = scripted_settings(model, "tiny-agent", nats_url=nats_url, outbox_dir=tmp / f"outbox-{name}",
                                 replica_id=name)  # fmt: skip
    return run_gateway(build_engine(settings), settings)


@pytest.fixture(scope="module")
def replicas(
    agent_model_path: Path, shared_nats: EmbeddedNatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunningGateway]]:
    tmp = tmp_path_factory.mktemp("replicas")
    with (
        _replica(agent_model_path, shared_nats.url, "a", tmp) as a,
        _replica(agent_model_path, shared_nats.url, "b", tmp) as b,
    ):
        yield [a, b]


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _chat(replica: RunningGateway, key: str, session: str, messages: list[dict[str, Any]]) -> Any:
    with OpenAI(base_url=f"{replica.base_url}/sessions/{session}/v1", api_key=key, max_retries=0, timeout=60) as c:
        return c.chat.completions.create(model="tiny-agent", messages=messages, extra_body={"return_token_ids": True})  # type: ignore[arg-type]


def _session(replica: RunningGateway, key: str, session: str) -> httpx.Response:
    return httpx.get(f"{replica.base_url}/sessions/{session}", headers=_headers(key), timeout=30)


def _one_exact_chain(body: dict[str, Any], turns: int) -> list[dict[str, Any]]:
    """The session's turns, one chain, each prompt its parent's prompt and sampled ids then new ids."""
    assert len(body["turns"]) == turns and len(body["chains"]) == 1, body["chains"]
    by_id = {t["turn_id"]: t for t in body["turns"]}
    ordered = [by_id[t] for t in body["chains"][0]["turn_ids"]]
    for parent, child in itertools.pairwise(ordered):
        assert child["parent_id"] == parent["turn_id"]
        head = parent["prompt_ids"] + parent["output_ids"]
        assert child["prompt_ids"][: len(head)] == head
    return ordered


def test_two_tenants_each_continue_their_own_run_1_on_either_replica(replicas: list[RunningGateway]) -> None:
    a, b = replicas
    session = f"run-1-{secrets.token_hex(3)}"
    said = {ALICE: "alice's question", BOB: "bob's question"}
    history: dict[str, list[dict[str, Any]]] = {k: [{"role": "user", "content": v}] for k, v in said.items()}
    for first, second in ((a, b), (b, a)):  # alice starts on a, bob on b; then each moves over
        for key, replica in ((ALICE, first), (BOB, second)):
            answer = _chat(replica, key, session, history[key])
            assert answer.choices[0].message.content == "Hello from tiny-agent."
            history[key] += [{"role": "assistant", "content": answer.choices[0].message.content},
                             {"role": "user", "content": "and then?"}]  # fmt: skip
    tokenizer = a.engine.tokenizer
    for key in (ALICE, BOB):
        for replica in (a, b):
            response = _session(replica, key, session)
            assert response.status_code == 200, response.text
            turns = _one_exact_chain(response.json(), 2)
            prompt = tokenizer.decode(turns[-1]["prompt_ids"])
            assert said[key] in prompt and said[ALICE if key == BOB else BOB] not in prompt
    alice, bob = _session(a, ALICE, session).json(), _session(a, BOB, session).json()
    assert alice["turns"][0]["prompt_ids"] != bob["turns"][0]["prompt_ids"]
    assert {t["turn_id"] for t in alice["turns"]}.isdisjoint(t["turn_id"] for t in bob["turns"])


def test_another_tenants_name_answers_as_an_unused_one_on_every_route(replicas: list[RunningGateway]) -> None:
    a, b = replicas
    session = f"run-1-{secrets.token_hex(3)}"
    _chat(a, ALICE, session, [{"role": "user", "content": "hi"}])
    unused = f"{session}-x"

    def ask(replica: RunningGateway, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
        return httpx.request(method, f"{replica.base_url}{path}", headers=_headers(EVE), json=body, timeout=30)

    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/sessions/{}", None),
        ("POST", "/sessions/{}/feedback", {"score": 1.0}),
        ("POST", "/sessions/{}/turns/turn0/feedback", {"score": 1.0}),
        ("POST", "/sessions/{}/close", None),
    ]
    for replica in (a, b):
        for method, path, body in routes:
            theirs = ask(replica, method, path.format(session), body)
            nobodys = ask(replica, method, path.format(unused), body)
            assert theirs.status_code == nobodys.status_code == 404, (path, theirs.text)
            assert theirs.json() == orjson.loads(nobodys.content.replace(unused.encode(), session.encode())), path
            assert "sessions belong to the key that created them" in theirs.json()["error"]["message"]
    # Alice's session is untouched by all of it: open, one turn, no feedback.
    body = _session(b, ALICE, session).json()
    assert len(body["turns"]) == 1 and not body["closed"] and not body["feedback"]


def test_every_protocol_keeps_two_tenants_same_name_apart(replicas: list[RunningGateway]) -> None:
    a, b = replicas
    session = f"run-1-{secrets.token_hex(3)}"
    read_tool = {"name": "read", "input_schema": {"type": "object"}}
    for key, replica in ((ALICE, a), (BOB, b)):
        base = f"{replica.base_url}/sessions/{session}/v1"
        messages = httpx.post(f"{base}/messages", headers={**_headers(key), "x-api-key": key}, timeout=60, json={
            "model": "tiny-agent", "max_tokens": 64, "tools": [read_tool],
            "messages": [{"role": "user", "content": f"{key} reads"}]})  # fmt: skip
        assert messages.status_code == 200, messages.text
        assert [c["name"] for c in messages.json()["content"] if c["type"] == "tool_use"] == ["read"]
        responses = httpx.post(f"{base}/responses", headers=_headers(key), timeout=60, json={
            "model": "tiny-agent", "input": f"{key} says hi", "max_output_tokens": 32})  # fmt: skip
        assert responses.status_code == 200, responses.text
        prompt = replica.engine.tokenizer.encode(f"<|im_start|>user\n{key}<|im_end|>\n<|im_start|>assistant\n")
        tokens = httpx.post(f"{base}/completions", headers=_headers(key), timeout=60, json={
            "model": "tiny-agent", "prompt": prompt, "max_tokens": 8})  # fmt: skip
        assert tokens.status_code == 200, tokens.text
    for key, other in ((ALICE, BOB), (BOB, ALICE)):
        body = _session(b, key, session).json()
        assert len(body["turns"]) == 3
        text = orjson.dumps(body["turns"]).decode()
        assert other not in text  # nothing of the other tenant's same-named session


def test_a_session_stored_in_the_old_layout_continues_after_the_upgrade(
    replicas: list[RunningGateway], agent_model_path: Path, shared_nats: EmbeddedNatsServer, tmp_path: Path
) -> None:
    a, _ = replicas
    session = f"old-{secrets.token_hex(3)}"
    first = _chat(a, ALICE, session, [{"role": "user", "content": "hi"}])

    async def to_old_layout() -> None:  # what a replica before issue 55 stored: s.<session>, version 1
        nc = await nats.connect(shared_nats.url)
        try:
            kv = await nc.jetstream().key_value(BUCKET)
            new = await kv.get(record_key(tenant_id(ALICE), session))
            assert new.value
            record = orjson.loads(new.value)
            record["v"] = 1
            await kv.put(f"s.{session}", orjson.dumps(record))
            await kv.purge(record_key(tenant_id(ALICE), session))
        finally:
            await nc.close()

    anyio.run(to_old_layout)
    with _replica(agent_model_path, shared_nats.url, "upgraded", tmp_path) as upgraded:
        # Another tenant's same id is not the old record's: a session of its own.
        assert _session(upgraded, BOB, session).status_code == 404
        history = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "more"}]  # fmt: skip
        _chat(upgraded, ALICE, session, history)
        _one_exact_chain(_session(upgraded, ALICE, session).json(), 2)


def test_grpo_groups_never_mix_tenants() -> None:
    rng = random.Random(55)
    ours = [make_trajectory(rng, group="g1", prompt=[1, 2, 3]) for _ in range(2)]
    theirs = make_trajectory(rng, group="g1", prompt=[1, 2, 3]).model_copy(update={"tenant": "another-tenant"})
    assert ours[0].tenant != theirs.tenant
    for key in ("metadata:group", "prompt"):
        assert group_uid(ours[0], key) == group_uid(ours[1], key)
        assert group_uid(ours[0], key) != group_uid(theirs, key)
    assert group_uid(ours[0], "metadata:group") == f"{ours[0].tenant}/g1"
