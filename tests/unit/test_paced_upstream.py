"""``benchmarks/paced_upstream.py`` read by the engines it stands in for, over a real socket.

The benchmark's vLLM/SGLang-like server is only worth its figures if the ``vllm-http`` and
``sglang-http`` engines read its frames as they read a real server's: every token id of the
passage in order, its logprob, ``k`` alternatives, the finish reason. Its chat endpoint must carry
the same tokens as text (what LiteLLM relays in ``benchmarks/relay.py``). The server runs on its
own event loop in a thread; the engines and httpx are the real clients. The passage is tokenized
with the untrained ``tiny`` model's tokenizer (no weights are read), served as ``tiny``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import anyio
import httpx
import orjson
import pytest

from stream_gateway.engines import EngineStep, SamplingParams
from stream_gateway.engines.remote import RemoteEngine

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("paced_upstream", BENCHMARKS / "paced_upstream.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["paced_upstream"] = module
    spec.loader.exec_module(module)
    return module


paced_upstream = _load()


@pytest.fixture(scope="module")
def cycle(tiny_model_path: Path) -> Any:
    return paced_upstream.TokenCycle.from_model(tiny_model_path)


@pytest.fixture(scope="module")
def paced(cycle: Any) -> Iterator[tuple[Any, str]]:
    """The server at 2,000 tokens/s per stream, 1 ms to the first token, EOS after 12 tokens without
    ignore_eos, and its URL."""
    loop = asyncio.new_event_loop()
    server = paced_upstream.PacedUpstream(
        cycle, tokens_per_second=2000, first_token_s=0.001, stop_after=12, served_model_name="tiny"
    )
    listening = loop.run_until_complete(paced_upstream.start("127.0.0.1", 0, server))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def shut() -> None:
        listening.close()
        await listening.wait_closed()
        await asyncio.sleep(0.2)  # the clients' closes reach their connections

    try:
        yield server, f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(shut(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def upstream_url(paced: tuple[Any, str]) -> str:
    return paced[1]


def _generate(engine: RemoteEngine, params: SamplingParams) -> list[EngineStep]:
    async def run() -> list[EngineStep]:
        async with engine:
            return [step async for step in engine.generate("r1", [1, 5, 9], params)]

    return anyio.run(run)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_engines_read_one_token_per_step(tiny_model_path: Path, cycle: Any, upstream_url: str,
                                         protocol: Literal["vllm", "sglang"]) -> None:  # fmt: skip
    """The passage's ids cycled, with logprobs and 3 alternatives each; ``length`` at the end. A step
    holds the frames that arrived in one read: one token each at this pace, unless the reader fell behind."""
    engine = RemoteEngine(tiny_model_path, protocol=protocol, upstreams=(upstream_url,),
                          served_model_name="tiny")  # fmt: skip
    tokens = len(cycle.ids) + 5  # past the seam of the cycle
    steps = _generate(engine, SamplingParams(max_tokens=tokens, top_logprobs=3, ignore_eos=True))
    ids = [t for s in steps for t in s.token_ids]
    assert ids == [cycle.ids[i % len(cycle.ids)] for i in range(tokens)]
    assert [lp for s in steps for lp in s.logprobs] == [-0.05] * tokens
    top = [t for s in steps for t in s.top_logprobs or ()]
    assert len(top) == tokens and all(len(t) == 3 and t[0] == (i, -0.05) for t, i in zip(top, ids, strict=True))
    assert [s.finish_reason for s in steps] == [None] * (len(steps) - 1) + ["length"]


def test_a_fixed_stream_interval_puts_that_many_tokens_in_a_frame(
    tiny_model_path: Path, cycle: Any, upstream_url: str
) -> None:
    """``--upstream-stream-interval 4``: the engine asks for vLLM's ``stream_interval`` and the server
    (as vLLM does) sends the first token alone, then four a frame, the rest in the last; every id,
    logprob and alternative as one token a frame carries them."""
    engine = RemoteEngine(tiny_model_path, protocol="vllm", upstreams=(upstream_url,), served_model_name="tiny",
                          stream_interval=4, stream_interval_max=4)  # fmt: skip
    steps = _generate(engine, SamplingParams(max_tokens=23, top_logprobs=2, ignore_eos=True))
    ids = [t for s in steps for t in s.token_ids]
    assert ids == [cycle.ids[i % len(cycle.ids)] for i in range(23)]
    assert [lp for s in steps for lp in s.logprobs] == [-0.05] * 23
    assert [len(t) for s in steps for t in s.top_logprobs or ()] == [2] * 23
    # A step is what one read returned: frames may merge (a busy reader), never split.
    ends = set(itertools.accumulate(len(s.token_ids) for s in steps))
    assert ends <= {1, 5, 9, 13, 17, 21, 23}, ends
    assert steps[-1].finish_reason == "length"


def test_a_turn_without_ignore_eos_ends_with_eos(tiny_model_path: Path, cycle: Any, upstream_url: str) -> None:
    engine = RemoteEngine(tiny_model_path, protocol="vllm", upstreams=(upstream_url,), served_model_name="tiny")
    steps = _generate(engine, SamplingParams(max_tokens=40))
    assert sum(len(s.token_ids) for s in steps) == 12 and steps[-1].finish_reason == "stop"
    assert steps[-1].token_ids[-1] == cycle.eos_id


def test_chat_carries_the_same_tokens_as_text(cycle: Any, upstream_url: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    content, finish, usage = "", None, None
    with httpx.stream("POST", upstream_url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        frames = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    for frame in frames[:-1]:
        chunk = orjson.loads(frame)
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
        usage = chunk.get("usage") or usage
    texts = cycle.texts
    assert content == "".join(texts[i % len(texts)] for i in range(300))
    assert finish == "length" and usage is not None and usage["completion_tokens"] == 300


def test_health_models_and_refusals(upstream_url: str) -> None:
    assert httpx.get(upstream_url + "/health").status_code == 200
    card = httpx.get(upstream_url + "/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == paced_upstream.DEFAULT_MAX_MODEL_LEN
    assert httpx.get(upstream_url + "/get_model_info").json()["model_path"] == "tiny"
    assert httpx.post(upstream_url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 400
    assert httpx.get(upstream_url + "/nowhere").status_code == 404


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_sequential_turns_keep_one_connection(tiny_model_path: Path, paced: tuple[Any, str],
                                              protocol: Literal["vllm", "sglang"]) -> None:  # fmt: skip
    """vLLM writes ``data: [DONE]`` as its own chunk after the finishing frame (issue 38; the stand-in
    now does too): an engine that stops reading at the finish must still keep the connection, so
    six turns one after another use one connection, not six."""
    server, url = paced
    engine = RemoteEngine(tiny_model_path, protocol=protocol, upstreams=(url,), served_model_name="tiny")

    async def run() -> int:
        async with engine:
            before = server.connections
            for turn in range(6):
                params = SamplingParams(max_tokens=8, ignore_eos=True)
                steps = [step async for step in engine.generate(f"turn-{turn}", [1, 5, 9], params)]
                assert steps[-1].finish_reason == "length"
                await anyio.sleep(0.05)  # an agent's gap between turns: the tail has arrived
            return int(server.connections - before)

    assert anyio.run(run) == 1
