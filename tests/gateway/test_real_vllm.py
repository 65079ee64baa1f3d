"""The ``vllm-http`` engine in front of a real vLLM server (issue 38), not a stand-in.

vLLM here is the registry's CPU build (``tests/support/vllm_server.py``) serving the built-in
``tiny-agent`` model as it is. One server is shared by the module's tests. What is checked is read
from vLLM itself where it can be: the ids and logprobs vLLM answers for the same request (same
prompt ids, same seed), its access log (which connections the gateway used), its metrics (whether
a request stopped when its client left). A forward pass of the same weights over the recorded ids
reproduces the recorded logprobs (fp32).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.agent_loop import READ_TOOL, drive_session
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway, run_gateway
from ..support.vllm_server import VllmServer, run_vllm


@pytest.fixture(scope="module")
def vllm(agent_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with run_vllm(agent_model_path, "tiny-agent", tmp_path_factory.mktemp("vllm")) as server:
        yield server


@pytest.fixture(scope="module")
def front(vllm: VllmServer, agent_model_path: Path) -> Iterator[RunningGateway]:
    settings = Settings(model=str(agent_model_path), engine="vllm-http", upstreams=(vllm.url,),
                        served_model_name="tiny-agent")  # fmt: skip
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _session(front: RunningGateway, session: str) -> dict[str, Any]:
    response = httpx.get(f"{front.base_url}/sessions/{session}", headers={"authorization": "Bearer x"}, timeout=30)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def test_the_record_is_what_vllm_sampled(front: RunningGateway, vllm: VllmServer, agent_model_path: Path) -> None:
    """Two turns of a session: each turn's ids and logprobs are those vLLM answers itself for the
    same prompt ids and seed, the second prompt carries the first answer's ids (never re-tokenized),
    and a forward pass of the same weights over the whole chain reproduces every logprob."""
    session = "real-vllm-record"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the file notes.md, please."}]
    with OpenAI(base_url=f"{front.base_url}/sessions/{session}/v1", api_key="x", max_retries=0, timeout=60) as c:
        for seed in (11, 12):
            text = ""
            stream = c.chat.completions.create(
                model="tiny-agent",
                messages=messages,  # type: ignore[arg-type]
                stream=True,
                seed=seed,
                max_tokens=24,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    body = _session(front, session)
    first, second = body["turns"]
    assert second["parent_id"] == first["turn_id"] and second["reused_prompt_tokens"] > len(first["prompt_ids"])
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(first["output_ids"])] == (
        first["prompt_ids"] + first["output_ids"]
    )
    for turn, seed in ((first, 11), (second, 12)):
        direct = httpx.post(f"{vllm.url}/v1/completions", timeout=60, json={
            "model": "tiny-agent", "prompt": turn["prompt_ids"], "max_tokens": 24, "temperature": 1.0, "top_p": 1.0,
            "top_k": -1, "seed": seed, "logprobs": 0, "ignore_eos": True, "return_token_ids": True,
            "skip_special_tokens": False,
        }).json()["choices"][0]  # fmt: skip
        assert turn["output_ids"] == direct["token_ids"]
        torch.testing.assert_close(turn["logprobs"], direct["logprobs"]["token_logprobs"], atol=1e-5, rtol=0)
    (chain,) = body["chains"]
    model = AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()
    assert_chain_logprobs(model, chain["token_ids"], chain["mask"], chain["logprobs"], atol=1e-4)


def test_sequential_turns_keep_their_connection(front: RunningGateway, vllm: VllmServer) -> None:
    """vLLM writes ``data: [DONE]`` as its own chunk: six turns one after another still use one
    or two connections (its access log), not six."""
    before = len(vllm.completion_connections())
    with OpenAI(base_url=f"{front.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        for turn in range(6):
            client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": f"hi {turn}"}],
                                           max_tokens=8, extra_body={"ignore_eos": True})  # fmt: skip
            time.sleep(0.05)  # an agent's pause between turns
    used = vllm.completion_connections()[before:]
    assert len(used) == 6 and len(set(used)) <= 2, used


def test_a_client_that_leaves_stops_the_request_on_vllm(front: RunningGateway, vllm: VllmServer) -> None:
    """The client reads three chunks of a 3,000-token answer and goes: vLLM's own counters show the
    request stopped (nothing running, generated tokens no longer growing, far short of 3,000)."""
    generated = vllm.metric("vllm:generation_tokens_total")
    body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "go on"}], "stream": True,
            "max_tokens": 3000, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{front.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    deadline = time.monotonic() + 20
    while vllm.metric("vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "vLLM still runs the request its client left"
        time.sleep(0.1)
    stopped = vllm.metric("vllm:generation_tokens_total")
    time.sleep(1.0)
    assert vllm.metric("vllm:generation_tokens_total") == stopped
    assert stopped - generated < 3000


def test_a_tool_loop_through_vllm_is_one_token_exact_chain(
    front: RunningGateway, agent_model_path: Path, tmp_path: Path
) -> None:
    """tiny-agent, sampled by vLLM, calls ``read``; the result goes back; every later turn continues
    the one before on the ids vLLM sampled, and the chain's logprobs replay."""
    (tmp_path / "README.md").write_text("The project streams tokens.\n")
    session = "real-vllm-tools"
    with OpenAI(base_url=f"{front.base_url}/sessions/{session}/v1", api_key="x", max_retries=0, timeout=60) as c:
        messages = drive_session(c, "tiny-agent", [{"role": "user", "content": "What does the README say?"}],
                                 follow_ups=["Thanks. And again?"], workdir=tmp_path, tools=[READ_TOOL],
                                 temperature=1.0, seed=7, max_tokens=64)  # fmt: skip
    assert any(m.get("tool_calls") for m in messages if m["role"] == "assistant"), messages
    body = _session(front, session)
    turns = body["turns"]
    assert len(turns) >= 3 and all(t["finish_reason"] in ("stop", "tool_calls") for t in turns)
    assert [t["parent_id"] for t in turns[1:]] == [t["turn_id"] for t in turns[:-1]]
    (chain,) = body["chains"]
    model = AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()
    assert_chain_logprobs(model, chain["token_ids"], chain["mask"], chain["logprobs"], atol=1e-4)


def test_failover_when_one_of_two_real_servers_is_killed(
    vllm: VllmServer, agent_model_path: Path, tmp_path: Path
) -> None:
    """Two vLLM servers; the one serving a stream is SIGKILLed mid-answer: that stream ends with an
    error frame (a half-sent answer cannot move), the pool marks the server down, and the next
    requests all go to the survivor."""
    with run_vllm(agent_model_path, "tiny-agent", tmp_path, name="victim") as victim:
        settings = Settings(model=str(agent_model_path), engine="vllm-http", upstreams=(victim.url, vllm.url),
                            served_model_name="tiny-agent", upstream_health_interval_seconds=0.5)  # fmt: skip
        with run_gateway(build_engine(settings), settings) as running:
            body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "go on"}], "stream": True,
                    "max_tokens": 3000, "ignore_eos": True}  # fmt: skip
            frames: list[str] = []
            on_victim: bool | None = None
            with httpx.stream("POST", f"{running.base_url}/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
                    if len(frames) == 3 and on_victim is None:
                        on_victim = victim.metric("vllm:num_requests_running") > 0
                        victim.kill()
                        if not on_victim:
                            break  # the pool put it on the survivor: the kill only tests the pool below
            if on_victim:
                assert '"error"' in frames[-2] and frames[-1] == "[DONE]", frames[-3:]
            health: dict[str, Any] = {}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                health = running.health()
                if [u["healthy"] for u in health["upstreams"]] == [False, True]:
                    break
                time.sleep(0.2)
            assert [u["healthy"] for u in health["upstreams"]] == [False, True], health
            with OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
                for turn in range(4):
                    ask = [{"role": "user", "content": f"hi {turn}"}]
                    reply = client.chat.completions.create(model="tiny-agent", max_tokens=6, messages=ask)  # type: ignore[arg-type]
                    assert reply.choices[0].finish_reason in ("stop", "length")


def test_prefix_cache_hits_are_recorded_per_turn(front: RunningGateway) -> None:
    """vLLM's own prefix cache, as it reports it (``cached_tokens``): none for a new prompt, most of
    it for the next turn of the same session (its prompt extends the first turn's ids), on the turn
    and in ``/metrics``."""
    session = "real-vllm-cache"
    long_task = "Read every file under src/ and summarise what each one does. " * 40
    messages: list[dict[str, Any]] = [{"role": "user", "content": long_task}]
    with OpenAI(base_url=f"{front.base_url}/sessions/{session}/v1", api_key="x", max_retries=0, timeout=60) as c:
        for _ in range(2):
            reply = c.chat.completions.create(model="tiny-agent", messages=messages, max_tokens=8)  # type: ignore[arg-type]
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": "Go on."}]  # fmt: skip
    first, second = _session(front, session)["turns"]
    assert first["cached_prompt_tokens"] == 0
    assert len(first["prompt_ids"]) > 256 and second["cached_prompt_tokens"] >= 256
    assert second["cached_prompt_tokens"] <= len(second["prompt_ids"])
    metrics = httpx.get(f"{front.base_url}/metrics", timeout=30).text
    cached = next(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("gateway_prompt_tokens_cached_total"))  # fmt: skip
    assert cached >= second["cached_prompt_tokens"]
