"""The ``vllm-http`` engine in front of real servers: two gateway processes serving ``tiny-agent``
(the scripted engine on the untrained ``tiny``: tiny-agent's answers, real logprobs) through
vLLM's token-in API (``/v1/completions``), all over sockets.

The front gateway (``--engine vllm-http``) renders chat, parses tool calls and records sessions;
the upstream processes only produce token ids. What the front records must be as token-exact as
with an in-process engine: every recorded logprob equals a forward pass of the served (untrained)
model over the chain. Then the pool: affinity, a server killed mid-stream, servers added and removed at run time
(admin route and NATS KV bucket), and a client disconnect reaching the server. Routed experts of
``tiny-moe`` come through both protocols: from a gateway upstream (vLLM's per-choice npy) and from
the SGLang stand-in (raw int32 in ``meta_info``).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import nats
import numpy as np
import openai
import orjson
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import TurnRecord
from pipeline.policies import announce_policy
from stream_gateway import Settings
from stream_gateway.engines import EngineStep, ExpertShape, SamplingParams, build_engine
from stream_gateway.engines._pool import _rank
from stream_gateway.engines.remote import DIALECTS, Exchange, RemoteEngine, RouteCheck, UpstreamFailed, Wanted
from stream_gateway.engines.scripted import ScriptedEngine
from stream_gateway.engines.transformers import TransformersEngine
from stream_gateway.models import AGENT_AFTER_TOOL, AGENT_WITHOUT_TOOLS, resolve_model
from stream_gateway.moe import decode_routes

from ..support.agent_loop import READ_TOOL, drive_session
from ..support.capture import of_session, wait_for
from ..support.fidelity import assert_chain_logprobs
from ..support.moe import free_routes
from ..support.servers import RunningGateway, free_port, run_gateway, serve_app, wait_healthy
from ..support.sglang_server import create_sglang_app
from ..support.steps import read_steps
from ..support.waiting import wait_until

ADMIN = "admin-key"
MANY_TOKENS = 30_000  # an answer that outlasts any test's reading of it: cut short by a kill or an abort
BUCKET = "SG_TEST_UPSTREAMS"


class Upstream:
    """One ``stream-gateway serve`` process on a fixed port: ``tiny-agent``'s answers (the scripted
    engine) when ``scripted``, else plain ``tiny`` sampling (the transformers engine)."""

    def __init__(self, model: Path, log_dir: Path, *, scripted: bool) -> None:
        self.model = model
        self.engine, self.served = ("scripted", "tiny-agent") if scripted else ("transformers", "tiny")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"upstream-{self.port}.log"
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--model", str(self.model),
                   "--engine", self.engine, "--served-model-name", self.served, "--port", str(self.port),
                   "--log-level", "warning",
                   # The same request straight and through the front must give the same float bits:
                   # a borrowed prefix sums attention in another order (docs/engines.md).
                   "--prefix-cache-mb", "0"]  # fmt: skip
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

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = httpx.get(self.url + "/health", timeout=10).json()
        return result


@pytest.fixture(scope="module")
def upstreams(agent_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Upstream]]:
    log_dir = tmp_path_factory.mktemp("upstreams")
    servers = [Upstream(agent_model_path, log_dir, scripted=True) for _ in range(2)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def front(
    upstreams: list[Upstream],
    agent_model_path: Path,
    nats_server: EmbeddedNatsServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningGateway]:
    settings = Settings(
        model=str(agent_model_path),
        engine="vllm-http",
        served_model_name="tiny-agent",
        upstreams=tuple(u.url for u in upstreams),
        upstream_health_interval_seconds=0.3,
        upstream_health_timeout_seconds=1.0,
        admin_api_keys=(ADMIN,),
        nats_url=nats_server.url,
        outbox_dir=tmp_path_factory.mktemp("outbox"),
        upstreams_bucket=BUCKET,
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture(scope="module")
def reference_model(agent_model_path: Path) -> Any:
    """The served model itself (the untrained ``tiny`` under the script), for forward passes."""
    return AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()


def _client(front: RunningGateway, session_id: str | None = None) -> OpenAI:
    base = f"{front.base_url}/sessions/{session_id}/v1" if session_id else f"{front.base_url}/v1"
    return OpenAI(base_url=base, api_key=ADMIN, max_retries=0, timeout=60)


def _served(upstreams: list[Upstream]) -> list[int]:
    return [int(u.health()["total_requests"]) for u in upstreams]


def _admin(front: RunningGateway, body: dict[str, Any] | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {ADMIN}"}
    if body is None:
        response = httpx.get(front.base_url + "/admin/upstreams", headers=headers, timeout=30)
    else:
        response = httpx.post(front.base_url + "/admin/upstreams", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _pool(front: RunningGateway) -> RemoteEngine:
    assert isinstance(front.engine, RemoteEngine)
    return front.engine


def _wait_healthy_in_pool(front: RunningGateway, url: str, healthy: bool = True, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = next((u for u in _admin(front)["data"] if u["url"] == url), None)
        if entry is not None and entry["healthy"] == healthy:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} never became {'healthy' if healthy else 'unhealthy'}: {_admin(front)}")


def test_a_tool_loop_through_vllm_http_is_token_exact_and_sticks_to_one_server(
    front: RunningGateway, upstreams: list[Upstream], reference_model: Any, tmp_path: Path
) -> None:
    (tmp_path / "README.md").write_text("The project streams tokens.\n")
    session_id = f"remote{secrets.token_hex(4)}"
    before = _served(upstreams)
    messages = drive_session(
        _client(front, session_id),
        "tiny-agent",
        [{"role": "user", "content": "What does the README say?"}],
        follow_ups=["Thanks. And again?"],
        workdir=tmp_path,
        tools=[READ_TOOL],
        temperature=1.0,
        seed=7,
        max_tokens=64,
    )
    # tiny-agent's answers (the script): read the README, say it is done; again after the follow-up.
    said = [
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
        if m.get("tool_calls")
        else m["content"]
        for m in messages
        if m["role"] == "assistant"
    ]
    call = [("read", {"path": "README.md"})]
    assert said == [call, AGENT_AFTER_TOOL, call, AGENT_AFTER_TOOL], messages
    session = httpx.get(f"{front.base_url}/sessions/{session_id}", headers={"authorization": f"Bearer {ADMIN}"}).json()
    turns = session["turns"]
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop", "tool_calls", "stop"]
    # One chain: every later turn continues the previous one, reusing its sampled ids (T2).
    assert [t["parent_id"] for t in turns[1:]] == [t["turn_id"] for t in turns[:-1]]
    assert all(t["reused_prompt_tokens"] == len(p["prompt_ids"]) + len(p["output_ids"])
               for p, t in itertools.pairwise(turns))  # fmt: skip
    (chain,) = session["chains"]
    assert_chain_logprobs(reference_model, chain["token_ids"], chain["mask"], chain["logprobs"])
    # Affinity: every turn of the session went to one server.
    delta = [after - b for after, b in zip(_served(upstreams), before, strict=True)]
    assert sorted(delta) == [0, len(turns)], delta
    # The session and each turn rode upstream as X-Session-ID and X-Request-ID (what vLLM and session
    # routers read): the serving server, a gateway itself, recorded the turns under that session.
    serving = upstreams[delta.index(len(turns))]
    upstream_turns = httpx.get(f"{serving.url}/sessions/{session_id}", timeout=10).json()["turns"]
    assert [t["output_ids"] for t in upstream_turns] == [t["output_ids"] for t in turns]


def test_token_ids_and_logprobs_stream_through_unchanged(front: RunningGateway, upstreams: list[Upstream]) -> None:
    """The same seeded request straight to an upstream and through the front: identical ids and logprobs."""
    body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "temperature": 1.0, "seed": 11, "logprobs": True, "top_logprobs": 3, "return_token_ids": True,
            "extra_body": None}  # fmt: skip
    body.pop("extra_body")
    direct = httpx.post(upstreams[0].url + "/v1/chat/completions", json=body, timeout=60).json()
    via = httpx.post(front.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert via["prompt_token_ids"] == direct["prompt_token_ids"]
    assert via["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]
    assert via["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"]  # top alternatives included


def test_a_server_killed_mid_stream_ends_the_stream_with_an_error_and_the_next_request_succeeds(
    front: RunningGateway, upstreams: list[Upstream], nats_server: EmbeddedNatsServer
) -> None:
    session_id = f"kill{secrets.token_hex(4)}"
    client = _client(front, session_id)
    client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # The server that served the first turn serves the session's next one too (affinity).
    before = _served(upstreams)
    victim: Upstream | None = None
    # Long enough that the server is still sampling when it is killed, however slowly this client
    # reads (on a loaded machine a 3,000-token answer was all in the front's hands by then).
    stream = client.chat.completions.create(
        model="tiny-agent", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                                      {"role": "user", "content": "go on"}],
        stream=True, max_tokens=MANY_TOKENS, extra_body={"ignore_eos": True},
    )  # fmt: skip
    received = 0
    try:
        with pytest.raises(openai.APIError) as failure:
            for _chunk in stream:
                received += 1
                # The first token's chunk: the server is sampling now. Later, a reader starved by a
                # busy machine may find the whole answer already in the sockets' buffers (fcG did).
                if received == 2:
                    after = _served(upstreams)
                    victim = upstreams[0] if after[0] > before[0] else upstreams[1]
                    victim.kill()
        assert victim is not None
        assert "failed while streaming" in str(failure.value.message), failure.value
        events = of_session(
            wait_for(nats_server.url, lambda es: any(e.kind == "turn.aborted" for e in of_session(es, session_id))),
            session_id,
        )
        aborted = next(e for e in events if e.kind == "turn.aborted")
        assert isinstance(aborted, TurnRecord)
        assert aborted.reason == "engine_error" and victim.url in (aborted.detail or "")  # type: ignore[attr-defined]
        assert 0 < len(aborted.output_ids) < MANY_TOKENS
        # The same session's next request goes to the surviving server and succeeds.
        reply = client.chat.completions.create(
            model="tiny-agent", messages=[{"role": "user", "content": "hello again"}], max_tokens=4
        )
        assert reply.choices[0].finish_reason == "length"  # the first 4 of "Hello from tiny-agent."'s 10 tokens
        assert AGENT_WITHOUT_TOOLS.startswith(reply.choices[0].message.content or "-"), reply
    finally:  # the killed server comes back at its address, whatever happened (the next tests need it)
        if victim is not None:
            victim.start()
    _wait_healthy_in_pool(front, victim.url)  # and the health checks take it back


def test_a_client_disconnect_aborts_the_request_on_the_server(front: RunningGateway, upstreams: list[Upstream]) -> None:
    client = _client(front)
    stream = client.chat.completions.create(
        model="tiny-agent", messages=[{"role": "user", "content": f"talk {secrets.token_hex(3)}"}],
        stream=True, max_tokens=MANY_TOKENS, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while any(u.health()["active_requests"] for u in upstreams):
        assert time.monotonic() < deadline, [u.health() for u in upstreams]
        time.sleep(0.1)
    generated = sum(int(u.health()["total_generated_tokens"]) for u in upstreams)
    time.sleep(0.5)
    assert sum(int(u.health()["total_generated_tokens"]) for u in upstreams) == generated  # nothing still decoding
    assert _pool(front).statistics().active_requests == 0


def test_a_slow_reader_through_a_pushing_front_gets_every_token_once_in_order(
    upstreams: list[Upstream], agent_model_path: Path
) -> None:
    """The remote engine pushes steps into the response from the upstream connection's callbacks:
    a client that stops reading makes the front's writes wait (a small send buffer, a big answer
    with top logprobs), the held frames go out in order once it reads again, and nothing is lost
    or doubled: what it read is what the front recorded."""
    settings = Settings(model=str(agent_model_path), engine="vllm-http", served_model_name="tiny-agent",
                        upstreams=tuple(u.url for u in upstreams), sse_send_timeout_seconds=120)  # fmt: skip
    tokens = 800
    body = {"model": "tiny-agent", "messages": [{"role": "user", "content": f"go on {secrets.token_hex(3)}"}],
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": tokens, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3, "return_token_ids": True}  # fmt: skip
    with run_gateway(build_engine(settings), settings, send_buffer=4096) as slow_front:
        port = int(slow_front.base_url.rsplit(":", 1)[1])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.sock = sock
        conn.request("POST", "/v1/chat/completions", orjson.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        session_id = response.getheader("x-session-id")
        time.sleep(2.0)  # read nothing for a while: the front's writes wait, and its reads of the server pause
        raw = bytearray()
        while chunk := response.read1(2048):
            raw += chunk
            time.sleep(0.002)
        conn.close()
        turn = httpx.get(f"{slow_front.base_url}/sessions/{session_id}", timeout=10).json()["turns"][0]
    frames = [orjson.loads(f[6:]) for f in bytes(raw).split(b"\n\n") if f.startswith(b"data: {")]
    content = [f["choices"][0] for f in frames if f["choices"] and "token_ids" in f["choices"][0]]
    ids = [t for c in content for t in c["token_ids"]]
    entries = [e for c in content for e in c["logprobs"]["content"]]
    assert ids == turn["output_ids"] and len(ids) == tokens  # every token once, in order
    assert [e["logprob"] for e in entries] == turn["logprobs"]
    assert "".join(c["delta"].get("content", "") for c in content) == turn["message"]["content"]
    assert frames[-1]["usage"]["completion_tokens"] == tokens
    assert content[-1]["finish_reason"] == "length"
    assert raw.endswith(b"data: [DONE]\n\n")


def test_a_server_added_at_run_time_takes_traffic_and_a_removed_one_none(
    front: RunningGateway, upstreams: list[Upstream], tiny_model_path: Path, tmp_path: Path
) -> None:
    extra = Upstream(tiny_model_path, tmp_path, scripted=False)  # plain tiny: its answers are not read
    extra.start()
    try:
        added = _admin(front, {"add": [extra.url]})
        assert added["added"] == [extra.url]
        _wait_healthy_in_pool(front, extra.url)

        # Sessions go to their home server (rendezvous hashing): three whose home is the new one, three not.
        urls = [u["url"] for u in _admin(front)["data"]]
        homes = {f"burst-{i}": max(urls, key=lambda url, i=i: _rank(f"burst-{i}", url)) for i in range(200)}
        sessions = [k for k, url in homes.items() if url == extra.url][:3]
        sessions += [k for k, url in homes.items() if url != extra.url][:3]

        async def burst() -> None:
            client = openai.AsyncOpenAI(base_url=front.base_url + "/v1", api_key=ADMIN, max_retries=0)
            async with client, anyio.create_task_group() as tg:
                for session in sessions:
                    tg.start_soon(lambda s=session: client.chat.completions.create(
                            model="tiny-agent", messages=[{"role": "user", "content": f"burst {s}"}],
                            max_tokens=24, extra_body={"ignore_eos": True},
                            extra_headers={"x-session-id": s}))  # fmt: skip

        anyio.run(burst)
        assert extra.health()["total_requests"] >= 3  # the new server is home to some sessions at once
        removed = _admin(front, {"remove": [extra.url]})
        assert removed["removed"] == [extra.url] and extra.url not in [u["url"] for u in removed["data"]]
        served = extra.health()["total_requests"]
        anyio.run(burst)
        assert extra.health()["total_requests"] == served
    finally:
        extra.stop()


def test_servers_follow_a_nats_kv_bucket(
    front: RunningGateway, tiny_model_path: Path, nats_server: EmbeddedNatsServer, tmp_path: Path
) -> None:
    extra = Upstream(tiny_model_path, tmp_path, scripted=False)
    extra.start()

    async def put(value: str | None) -> None:
        nc = await nats.connect(nats_server.url)
        try:
            kv = await nc.jetstream().create_key_value(bucket=BUCKET)
            if value is None:
                await kv.delete("rollout-0")
            else:
                await kv.put("rollout-0", value.encode())
        finally:
            await nc.close()

    try:
        anyio.run(put, extra.url)
        _wait_healthy_in_pool(front, extra.url)
        anyio.run(put, None)
        deadline = time.monotonic() + 20
        while extra.url in [u["url"] for u in _admin(front)["data"]]:
            assert time.monotonic() < deadline, "the deleted key's server stayed in the pool"
            time.sleep(0.1)
    finally:
        extra.stop()


def test_admin_routes_need_an_admin_key_and_valid_addresses(front: RunningGateway) -> None:
    response = httpx.post(front.base_url + "/admin/upstreams", json={"add": ["http://127.0.0.1:1"]},
                          headers={"authorization": "Bearer someone"})  # fmt: skip
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
    response = httpx.post(front.base_url + "/admin/upstreams", json={"add": ["ftp://x"]},
                          headers={"authorization": f"Bearer {ADMIN}"})  # fmt: skip
    assert response.status_code == 400 and "not an http(s) server address" in response.json()["error"]["message"]
    response = httpx.post(front.base_url + "/admin/upstreams", json={"add": "http://x"},
                          headers={"authorization": f"Bearer {ADMIN}"})  # fmt: skip
    assert response.status_code == 400


def test_no_healthy_server_is_a_503_not_a_hang(tiny_model_path: Path) -> None:
    port = free_port()  # nothing listens there
    settings = Settings(model=str(tiny_model_path), engine="vllm-http", served_model_name="tiny",
                        upstreams=(f"http://127.0.0.1:{port}",), upstream_health_interval_seconds=0.2)  # fmt: skip
    with run_gateway(build_engine(settings), settings) as running:
        health = httpx.get(running.base_url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["upstreams"][0]["healthy"] is False
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        response = httpx.post(running.base_url + "/v1/chat/completions", timeout=30, json=body)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_unavailable"
        assert "No healthy inference server" in response.json()["error"]["message"]


# -- sglang-http, against a server speaking SGLang's /generate protocol (tests/support/sglang_server.py)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative-frames", "incremental-frames"])
def test_sglang_http_streams_token_exact_turns(agent_model_path: Path, reference_model: Any, incremental: bool) -> None:
    upstream_engine = ScriptedEngine(agent_model_path, served_model_name="tiny-agent")  # tiny-agent's call of read
    with serve_app(create_sglang_app(upstream_engine, incremental=incremental)) as url:
        settings = Settings(model=str(agent_model_path), engine="sglang-http", served_model_name="tiny-agent",
                            upstreams=(url,))  # fmt: skip
        with run_gateway(build_engine(settings), settings) as running:
            session_id = f"sgl{secrets.token_hex(4)}"
            client = _client(running, session_id)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What does the README say?"}]
            stream = client.chat.completions.create(model="tiny-agent", messages=messages, tools=[READ_TOOL],  # type: ignore[list-item]
                                                    stream=True, max_tokens=48, temperature=1.0, seed=5,
                                                    logprobs=True, top_logprobs=2)  # fmt: skip
            chunks = list(stream)
            calls = [d.function for c in chunks for ch in c.choices for d in ch.delta.tool_calls or [] if d.function]
            assert [f.name for f in calls if f.name] == ["read"], calls
            assert json.loads("".join(f.arguments or "" for f in calls)) == {"path": "README.md"}
            tops = [
                e.top_logprobs
                for c in chunks
                for ch in c.choices
                for e in (ch.logprobs.content if ch.logprobs else None) or []
            ]
            assert tops and all(len(t) == 2 for t in tops)
            auth = {"authorization": f"Bearer {ADMIN}"}
            session = httpx.get(f"{running.base_url}/sessions/{session_id}", headers=auth).json()
            (turn,) = session["turns"]
            assert turn["finish_reason"] == "tool_calls"
            (chain,) = session["chains"]
            assert_chain_logprobs(reference_model, chain["token_ids"], chain["mask"], chain["logprobs"])
            assert turn["policy_version"] == 0  # "default" is no number: the pool's version
            # A numeric weight_version (set with the weights) labels the tokens from then on.
            httpx.post(url + "/update_weights_from_disk", json={"model_path": "x", "weight_version": "7"})
            client.chat.completions.create(
                model="tiny-agent", messages=[{"role": "user", "content": "yo"}], max_tokens=3
            )
            turns = httpx.get(f"{running.base_url}/sessions/{session_id}", headers=auth).json()["turns"]
            assert turns[-1]["policy_version"] == 7 and turns[-1]["policy_versions"] == [[7, 0]]


def test_sglang_http_reports_an_aborted_request_as_an_error(tiny_model_path: Path) -> None:
    upstream_engine = TransformersEngine(tiny_model_path, served_model_name="tiny")
    with serve_app(create_sglang_app(upstream_engine, abort_after=3)) as url:
        settings = Settings(model=str(tiny_model_path), engine="sglang-http", served_model_name="tiny",
                            upstreams=(url,))  # fmt: skip
        with run_gateway(build_engine(settings), settings) as running:
            stream = _client(running).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=50,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            with pytest.raises(openai.APIError, match="aborted the request"):
                list(stream)


def test_a_server_too_busy_to_answer_its_check_stays_in_rotation_while_it_streams(tiny_model_path: Path) -> None:
    """A server whose ``/health`` waits past the check's timeout while its streams flow (a real vLLM
    saturated on two cores did, and the pool's only server went out of rotation: 503 for every
    client while it served) is busy, not gone: it keeps taking requests. Once nothing streams from
    it, the same slow check takes it out."""
    delay = {"s": 0.0}
    upstream_engine = TransformersEngine(tiny_model_path, served_model_name="tiny")
    with serve_app(create_sglang_app(upstream_engine, health_delay=lambda: delay["s"])) as url:
        settings = Settings(model=str(tiny_model_path), engine="sglang-http", served_model_name="tiny",
                            upstreams=(url,), admin_api_keys=(ADMIN,), upstream_health_interval_seconds=0.2,
                            upstream_health_timeout_seconds=0.3)  # fmt: skip
        with run_gateway(build_engine(settings), settings) as running:
            _wait_healthy_in_pool(running, url)
            delay["s"] = 2.0  # from now on every check times out
            chunks = []
            stream = _client(running).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
                max_tokens=MANY_TOKENS, extra_body={"ignore_eos": True},
            )  # fmt: skip
            with ThreadPoolExecutor(1) as pool:
                reading = pool.submit(lambda: chunks.extend(stream))
                try:
                    wait_until(lambda: _entry(running, url)["slow_checks"] >= 3, "3 checks timed out while streaming")
                    assert _entry(running, url)["healthy"], _admin(running)
                    reply = _client(running).chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "and you?"}], max_tokens=4
                    )
                    assert reply.choices[0].finish_reason in ("stop", "length")
                finally:
                    stream.close()  # the client goes: the server's stream ends, and nothing flows
                    with contextlib.suppress(Exception):
                        reading.result(30)
            assert chunks
            _wait_healthy_in_pool(running, url, healthy=False)
            assert "no answer in time" in str(_entry(running, url)["last_error"])


def _entry(front: RunningGateway, url: str) -> dict[str, Any]:
    return next(u for u in _admin(front)["data"] if u["url"] == url)


def test_a_remote_pool_follows_announced_versions_and_reported_ones(
    upstreams: list[Upstream], agent_model_path: Path, tmp_path: Path
) -> None:
    """``announce_policy`` moves a vllm-http gateway's version without any weights; a server that
    reports versions per chunk (a stream-gateway upstream) still labels its own tokens."""
    with EmbeddedNatsServer() as server:
        settings = Settings(model=str(agent_model_path), engine="vllm-http", served_model_name="tiny-agent",
                            upstreams=(upstreams[0].url,), nats_url=server.url, outbox_dir=tmp_path)  # fmt: skip
        with run_gateway(build_engine(settings), settings) as running:

            async def announce() -> None:
                nc = await nats.connect(server.url)
                try:
                    await announce_policy(nc, 41, weights="verl step 41")
                finally:
                    await nc.close()

            anyio.run(announce)
            deadline = time.monotonic() + 30
            while running.health()["policy_version"] != 41:
                assert time.monotonic() < deadline, running.health()
                time.sleep(0.1)
            session_id = f"ver{secrets.token_hex(4)}"
            _client(running, session_id).chat.completions.create(
                model="tiny-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            auth = {"authorization": f"Bearer {ADMIN}"}
            (turn,) = httpx.get(f"{running.base_url}/sessions/{session_id}", headers=auth).json()["turns"]
            assert turn["policy_version"] == 0 and turn["policy_versions"] == [[0, 0]]  # the upstream's weight_versions


# -- routed experts (R3) of tiny-moe through remote engines


@pytest.fixture(scope="module")
def moe_path() -> Path:
    return Path(resolve_model("tiny-moe"))


@pytest.fixture(scope="module")
def moe_reference(moe_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


def _moe_conversation(front: RunningGateway, session_id: str) -> list[dict[str, Any]]:
    """Two chained chat turns on the front; its session's turns with their routes."""
    client = _client(front, session_id)
    messages: list[Any] = [{"role": "user", "content": "What is in the README?"}]
    reply = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=12, temperature=1.0, seed=3)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
    messages += [{"role": "user", "content": "And?"}]
    client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=12, temperature=1.0, seed=4)
    session = httpx.get(f"{front.base_url}/sessions/{session_id}", params={"include": "routed_experts"},
                        headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)  # fmt: skip
    assert session.status_code == 200, session.text
    turns: list[dict[str, Any]] = session.json()["turns"]
    assert len(turns) == 2 and turns[1]["parent_id"] == turns[0]["turn_id"]
    return turns


def _generate(engine: RemoteEngine, prompt: list[int], params: SamplingParams) -> list[EngineStep]:
    async def run() -> list[EngineStep]:
        async with engine:
            return [step async for step in engine.generate(f"r{secrets.token_hex(3)}", prompt, params)]

    return anyio.run(run)


def _check_routes_from(engine_of: Any, prompt: list[int]) -> None:
    """Asked from position 3, the server's rows are the whole's from 3 on, on the last step alone."""
    whole = _generate(engine_of(), prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, routes_from=3)
    later = _generate(engine_of(), prompt, params)
    for steps in (whole, later):
        assert all(s.routes is None for s in steps[:-1]) and steps[-1].routes is not None
    assert [t for s in whole for t in s.token_ids] == [t for s in later for t in s.token_ids]
    full, tail = whole[-1].routes, later[-1].routes
    assert full is not None and tail is not None
    assert full.dtype == np.uint8 and full.shape == (len(prompt) + 5 - 1, 3, 2)
    assert (whole[-1].routes_start, later[-1].routes_start) == (0, 3)
    assert np.array_equal(tail, full[3:])


def test_vllm_http_records_the_routes_its_upstream_gateway_recorded(moe_path: Path, moe_reference: Any) -> None:
    upstream_settings = Settings(model=str(moe_path), served_model_name="tiny-moe")
    with run_gateway(build_engine(upstream_settings), upstream_settings) as upstream:
        settings = Settings(model=str(moe_path), engine="vllm-http", served_model_name="tiny-moe",
                            upstreams=(upstream.base_url,))  # fmt: skip
        with run_gateway(build_engine(settings), settings) as front:
            turns = _moe_conversation(front, f"moe{secrets.token_hex(4)}")
            # The upstream's own record of the same turns (token-in, chained by id prefix): a probe
            # extending the last turn lands in their session.
            last = turns[-1]
            probe = {"model": "tiny-moe", "prompt": last["prompt_ids"] + last["output_ids"] + [5], "max_tokens": 1}
            upstream_session = httpx.post(upstream.base_url + "/v1/completions", json=probe, timeout=60).headers[
                "x-session-id"
            ]
            theirs = httpx.get(f"{upstream.base_url}/sessions/{upstream_session}",
                               params={"include": "routed_experts"}, timeout=30).json()["turns"]  # fmt: skip
            for turn in turns:
                key = (turn["prompt_ids"], turn["output_ids"])
                (same,) = [t for t in theirs if (t["prompt_ids"], t["output_ids"]) == key]
                assert turn["routed_experts"] == same["routed_experts"]
                routes = decode_routes(turn["routed_experts"])
                assert routes.shape == (len(turn["prompt_ids"]) + len(turn["output_ids"]) - 1, 3, 2)
            # The front's own token-in API returns them too, in vLLM's format, from a start.
            body = {"model": "tiny-moe", "prompt": [1, 85, 741, 201, 1462], "max_tokens": 6, "stream": True,
                    "return_token_ids": True, "return_routed_experts": True, "routed_experts_start_len": 2}  # fmt: skip
            chunks = [orjson.loads(line[6:]) for line in httpx.post(front.base_url + "/v1/completions", json=body,
                      timeout=60).text.splitlines() if line.startswith("data: {")]  # fmt: skip
            value = chunks[-1]["choices"][0]["routed_experts"]
            ids = body["prompt"] + [t for c in chunks for t in c["choices"][0]["token_ids"]]  # type: ignore[operator]
            routes = np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)
            free = free_routes(moe_reference, ids)[2:]
            assert routes.shape == free.shape
            assert (np.sort(routes, axis=-1) == np.sort(free, axis=-1)).all(axis=-1).mean() >= 0.999

        # The engine alone: a start reaches the server (routed_experts_prompt_start), rows come from there.
        def engine() -> RemoteEngine:
            return RemoteEngine(moe_path, protocol="vllm", upstreams=(upstream.base_url,),
                                served_model_name="tiny-moe", routed_experts=True)  # fmt: skip

        _check_routes_from(engine, [1, 85, 741, 201, 1462, 941])


def test_a_server_that_refuses_routed_experts_serves_without_them(moe_path: Path) -> None:
    """A gateway upstream with routes off answers return_routed_experts with a 400: the front asks it
    again without, records the turn without routes, and stops asking."""
    upstream_settings = Settings(model=str(moe_path), served_model_name="tiny-moe", routed_experts=False)
    with run_gateway(build_engine(upstream_settings), upstream_settings) as upstream:
        settings = Settings(model=str(moe_path), engine="vllm-http", served_model_name="tiny-moe",
                            upstreams=(upstream.base_url,))  # fmt: skip
        with run_gateway(build_engine(settings), settings) as front:
            session_id = f"noroutes{secrets.token_hex(4)}"
            for _ in range(2):
                reply = _client(front, session_id).chat.completions.create(
                    model="tiny-moe", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                assert reply.choices[0].finish_reason in ("stop", "length")
            turns = httpx.get(f"{front.base_url}/sessions/{session_id}", params={"include": "routed_experts"},
                              headers={"authorization": f"Bearer {ADMIN}"}, timeout=30).json()["turns"]  # fmt: skip
            assert len(turns) == 2 and all(t["routed_experts"] is None for t in turns)
            assert _pool(front)._route_check.routeless == {upstream.base_url}


def test_sglang_http_records_the_stand_ins_routes(moe_path: Path, moe_reference: Any) -> None:
    upstream_engine = TransformersEngine(moe_path, served_model_name="tiny-moe")
    with serve_app(create_sglang_app(upstream_engine)) as url:
        settings = Settings(model=str(moe_path), engine="sglang-http", served_model_name="tiny-moe", upstreams=(url,))
        with run_gateway(build_engine(settings), settings) as front:
            turns = _moe_conversation(front, f"sglmoe{secrets.token_hex(4)}")
            agree = total = 0
            for turn in turns:
                routes = decode_routes(turn["routed_experts"])
                ids = turn["prompt_ids"] + turn["output_ids"]
                assert routes.dtype == np.uint8 and routes.shape == (len(ids) - 1, 3, 2)
                same = (np.sort(routes, axis=-1) == np.sort(free_routes(moe_reference, ids), axis=-1)).all(axis=-1)
                agree, total = agree + int(same.sum()), total + same.size
            assert agree / total >= 0.999, f"{total - agree} of {total} (position, layer) routes differ"
            experts = front.engine.experts
            assert experts is not None and (experts.layers, experts.top_k, experts.num_experts) == (3, 2, 8)
        prompt = [1, 85, 741, 201, 1462, 941]

        def engine() -> RemoteEngine:
            return RemoteEngine(moe_path, protocol="sglang", upstreams=(url,), served_model_name="tiny-moe",
                                routed_experts=True)  # fmt: skip

        _check_routes_from(engine, prompt)  # routed_experts_start_len
        with pytest.raises(UpstreamFailed, match="routed_experts_start_len"):  # SGLang aborts a start past the prompt
            _generate(engine(), prompt, SamplingParams(max_tokens=2, routes_from=len(prompt) + 1))


def test_routes_in_the_other_documented_shapes_areread_steps(moe_path: Path) -> None:
    """What the stand-ins do not send: SGLang's ``sglext`` on a trailing ``choices: []`` frame (its
    OpenAI endpoints), a vLLM that ignored the start (before 0.33: whole rows), and a wrong row count."""
    check = RouteCheck(ExpertShape(3, 2, 8))
    rows = np.arange(4 * 3 * 2, dtype="<i4").reshape(4, 3, 2) % 8  # prompt 3 + output 2 - 1
    meta = {"finish_reason": {"type": "length"}, "completion_tokens": 2,
            "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]]}  # fmt: skip

    def read(frames: list[dict[str, Any]], protocol: str, start: int = 0, together: bool = False) -> list[EngineStep]:
        reads = [frames] if together else [[frame] for frame in frames]  # each frame its own read, or all in one
        return read_steps(
            DIALECTS[protocol]().reader(Exchange("http://x", 0, Wanted(3, start), check, None, lambda: 0)), reads
        )

    trailing = [
        {"meta_info": meta},
        {"choices": [], "sglext": {"routed_experts": base64.b64encode(rows.tobytes()).decode()}},
    ]
    for together in (False, True):
        (step,) = read(trailing, "sglang", 0, together)
        assert step.routes is not None and step.routes.dtype == np.uint8 and np.array_equal(step.routes, rows)
    (step,) = read([{"meta_info": meta}], "sglang")  # none sent: the step still ends the request
    assert step.finish_reason == "length" and step.routes is None

    buffer = io.BytesIO()
    np.save(buffer, rows.astype(np.uint8))
    choice = {"finish_reason": "length", "token_ids": [11, 12], "logprobs": {"token_logprobs": [-0.5, -0.25]},
              "routed_experts": base64.b64encode(buffer.getvalue()).decode()}  # fmt: skip
    (step,) = read([{"choices": [choice]}], "vllm", 2)  # asked from 2, sent whole
    assert step.routes_start == 0 and np.array_equal(step.routes, rows)
    short = {**choice, "token_ids": [11], "logprobs": {"token_logprobs": [-0.5]}}
    (step,) = read([{"choices": [short]}], "vllm")  # 4 rows for 3 positions: not kept
    assert step.routes is None


def test_images_through_a_remote_engine_are_refused_saying_why(front: RunningGateway) -> None:
    """vLLM's token-in API takes no images with prompt ids: a clear 400, never a re-rendered prompt."""
    png = (
        "data:image/png;base64,"
        + "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    )
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": png}}]
    with (
        OpenAI(base_url=f"{front.base_url}/v1", api_key="sk-remote", max_retries=0) as client,
        pytest.raises(openai.BadRequestError, match="sends no images to its servers") as refused,
    ):
        client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": content}])
    assert refused.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]


def test_an_unexpected_error_in_a_health_check_marks_the_server_down_and_the_checks_go_on(
    tiny_model_path: Path,
) -> None:
    """A server answering ``/v1/models`` with a JSON list once raised out of a check and ended the
    health loop (and the engine's task group with it): no server was ever checked again."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    answer: dict[str, Any] = {"models": []}  # a list where vLLM answers an object

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse(answer["models"])

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models)])
    with serve_app(app) as url:
        settings = Settings(model=str(tiny_model_path), engine="vllm-http", served_model_name="tiny",
                            upstreams=(url,), upstream_health_interval_seconds=0.1)  # fmt: skip

        async def scenario() -> None:
            engine = build_engine(settings)
            assert isinstance(engine, RemoteEngine)
            async with engine:
                upstream = next(iter(engine.pool))
                await anyio.sleep(0.5)  # five checks
                assert not upstream.healthy and "AttributeError" in (upstream.last_error or "")
                answer["models"] = {"data": [{"id": "tiny", "max_model_len": 4096}]}
                with anyio.fail_after(10):  # the checks went on: the fixed answer is seen
                    while True:
                        if upstream.healthy:
                            break
                        await anyio.sleep(0.05)
                assert upstream.model == "tiny"

        anyio.run(scenario)


def test_the_usage_frame_is_read_in_the_same_read_as_the_finishing_frame() -> None:
    """vLLM writes the usage frame (``cached_tokens``) right after the finishing frame: one read
    often holds both, and the finishing step still carries the prefix-cache count (seen against
    vLLM 0.32: a turn read its finish and let the usage frame go, recording ``None``)."""
    choice = {"finish_reason": "length", "token_ids": [11, 12], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}

    exchange = Exchange("http://x", 0, None, RouteCheck(None), None, lambda: 0)
    for reads in ([[{"choices": [choice]}, usage]], [[{"choices": [choice]}], [usage]]):
        (step,) = read_steps(DIALECTS["vllm"]().reader(exchange), reads)
        together = len(reads) == 1
        assert (step.token_ids, step.finish_reason, step.cached_prompt_tokens) == ((11, 12), "length", 8), together
