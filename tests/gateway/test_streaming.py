"""The per-token path's contract: a fast reader gets one token per chunk, a slow one gets every token
exactly once, in order, coalesced into fewer chunks with exact ids and logprobs; keep-alive pings
and the send timeout still hold without a cancel scope per frame."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import orjson
import pytest
from openai import OpenAI

from stream_gateway import Settings
from stream_gateway._errors import EngineError
from stream_gateway.completion._channel import UpdateChannel, coalesce, fold_tool_calls
from stream_gateway.engines import build_engine
from stream_gateway.protocols._chat import ChoiceUpdate
from stream_gateway.tool_parsers import ToolCallDelta

from ..support.servers import RunningGateway, run_gateway
from ..support.waiting import wait_until


def _update(index: int, text: str, ids: list[int], **extra: Any) -> ChoiceUpdate:
    return ChoiceUpdate(index, text, ids, [-float(i) for i in ids], None, **extra)


def test_coalesce_merges_each_choice_in_order_and_keeps_the_error_last() -> None:
    items = [
        _update(0, "a", [1]),
        _update(1, "x", [7]),
        _update(0, "b", [2, 3]),
        _update(1, "y", [8], finish_reason="length", version_spans=[(0, 0)]),
        EngineError("boom"),
        _update(0, "never", [9]),  # nothing after an error is sent
    ]
    merged = coalesce(items)
    assert [type(m).__name__ for m in merged] == ["ChoiceUpdate", "ChoiceUpdate", "EngineError"]
    first, second = merged[0], merged[1]
    assert isinstance(first, ChoiceUpdate) and isinstance(second, ChoiceUpdate)
    assert (first.index, first.text, first.token_ids, first.logprobs, first.finish_reason) == (
        0,
        "ab",
        [1, 2, 3],
        [-1.0, -2.0, -3.0],
        None,
    )
    assert (second.text, second.token_ids, second.finish_reason, second.version_spans) == (
        "xy",
        [7, 8],
        "length",
        [(0, 0)],
    )
    # The producer's own lists are not modified (it may still hold them).
    assert items[0].token_ids == [1]  # type: ignore[union-attr]


def test_coalesce_keeps_thinking_and_the_final_fields() -> None:
    """Merged updates keep their thinking text, the thinking span and routes of the last."""
    routes = np.zeros((4, 3, 2), np.uint8)
    items = [
        _update(0, "", [1], reasoning="I think"),
        _update(0, "", [2], reasoning=" so."),
        _update(0, "Yes", [3], finish_reason="stop", reasoning_tokens=2, answer_start=2, routes=routes),
    ]
    [merged] = coalesce(items)
    assert isinstance(merged, ChoiceUpdate)
    assert (merged.reasoning, merged.text, merged.reasoning_tokens, merged.answer_start) == ("I think so.", "Yes", 2, 2)
    assert merged.routes is routes


def test_tool_call_fragments_fold_into_one_entry_per_call() -> None:
    deltas = (
        ToolCallDelta(0, "call_a", "read", ""),
        ToolCallDelta(0, None, None, '{"path": '),
        ToolCallDelta(0, None, None, '"README.md"}'),
        ToolCallDelta(1, "call_b", "ls", "{}"),
    )
    assert fold_tool_calls(deltas) == (
        ToolCallDelta(0, "call_a", "read", '{"path": "README.md"}'),
        ToolCallDelta(1, "call_b", "ls", "{}"),
    )
    # One update that carries a call's name and its arguments as two entries becomes one entry.
    [update] = coalesce([_update(0, "", [5], tool_calls=deltas[:2])])
    assert isinstance(update, ChoiceUpdate)
    assert update.tool_calls == (ToolCallDelta(0, "call_a", "read", '{"path": '),)


@pytest.mark.anyio
async def test_the_channel_hands_over_everything_waiting_and_ends_when_closed() -> None:
    channel = UpdateChannel()
    got: list[list[Any]] = []

    async def read() -> None:
        while (items := await channel.take()) is not None:
            got.append(items)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.sleep(0.01)  # the reader waits on an empty channel
        channel.put(_update(0, "a", [1]))
        await anyio.sleep(0.01)
        for i in range(2, 5):  # three puts before the reader runs again: one take
            channel.put(_update(0, str(i), [i]))
        channel.close()
    assert [[u.token_ids for u in items] for items in got] == [[[1]], [[2], [3], [4]]]


@pytest.fixture(scope="module")
def synthetic(tiny_model_path: Path) -> Iterator[RunningGateway]:
    """A synthetic engine paced at 400 tokens/s: the engine, not the path, sets the pace."""
    settings = Settings(
        model=str(tiny_model_path), engine="synthetic", served_model_name="synthetic", synthetic_tokens_per_second=400
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def test_a_reader_that_keeps_up_gets_one_token_per_chunk(synthetic: RunningGateway) -> None:
    with OpenAI(base_url=synthetic.base_url + "/v1", api_key="k", max_retries=0) as client:
        stream = client.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": "go"}],
            stream=True,
            max_tokens=64,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        # Chunks with token ids: all but the role chunk (and the usage chunk, which has no choices).
        counts = [len(c.choices[0].model_extra["token_ids"]) for c in stream if c.choices and c.choices[0].model_extra]
    assert counts == [1] * 64


def _stream_request(port: int, body: dict[str, Any], rcvbuf: int) -> tuple[http.client.HTTPConnection, Any]:
    """A streamed request on a socket with a small receive buffer (set before connecting)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.sock = sock
    conn.request("POST", "/v1/chat/completions", orjson.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _frames(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(f[6:]) for f in raw.split(b"\n\n") if f.startswith(b"data: {")]


def _generated(gateway: RunningGateway) -> int:
    """Tokens the gateway's engine has sampled since it started."""
    value = gateway.health()["total_generated_tokens"]
    assert isinstance(value, int)
    return value


@pytest.fixture
def small_send_buffer(tiny_model_path: Path) -> Iterator[RunningGateway]:
    """The tiny model behind connections with a small, fixed send buffer: with the one Linux grows to
    megabytes, a whole response fits in it and the server's writes never wait for the reader. The
    send timeout is long: a reader stops reading for as long as the engine takes, however slow."""
    settings = Settings(model=str(tiny_model_path), served_model_name="tiny", sse_send_timeout_seconds=120)
    with run_gateway(build_engine(settings), settings, send_buffer=4096) as running:
        yield running


def test_a_slow_reader_gets_every_token_once_in_order_with_exact_ids_and_logprobs(
    small_send_buffer: RunningGateway,
) -> None:
    gateway = small_send_buffer
    tokens = 800
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": tokens,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }
    port = int(gateway.base_url.rsplit(":", 1)[1])
    before = _generated(gateway)
    conn, response = _stream_request(port, body, rcvbuf=4096)
    session_id = response.getheader("x-session-id")
    raw = bytearray()
    # Read nothing until the engine has sampled every token: the buffers on the way take under a
    # hundred kilobytes of frames, then the server's writes wait and the other tokens gather.
    wait_until(lambda: _generated(gateway) - before >= tokens, "the engine to sample every token")
    while chunk := response.read1(2048):
        raw += chunk
        time.sleep(0.005)  # then read slowly
    conn.close()
    frames = _frames(bytes(raw))
    content = [f["choices"][0] for f in frames if f["choices"] and "token_ids" in f["choices"][0]]
    per_chunk = [len(c["token_ids"]) for c in content]
    # The tokens sampled while the writes waited went out together (a chunk of one update can
    # already carry a few tokens, a character split across them).
    assert max(per_chunk) > tokens // 2, f"at most {max(per_chunk)} tokens in one of {len(per_chunk)} chunks"
    ids = [t for c in content for t in c["token_ids"]]
    entries = [e for c in content for e in c["logprobs"]["content"]]
    assert all(len(c["token_ids"]) == len(c["logprobs"]["content"]) for c in content)
    assert frames[-1]["usage"]["completion_tokens"] == tokens
    assert raw.endswith(b"data: [DONE]\n\n")

    turn = httpx.get(f"{gateway.base_url}/sessions/{session_id}", timeout=10).json()["turns"][0]
    assert ids == turn["output_ids"]  # every token once, in order
    assert [e["logprob"] for e in entries] == turn["logprobs"]
    assert all(len(e["top_logprobs"]) == 3 for e in entries)
    assert "".join(c["delta"].get("content", "") for c in content) == turn["message"]["content"]
    assert content[-1]["finish_reason"] == "length"


def test_an_idle_stream_gets_keep_alive_comments(tiny_model_path: Path) -> None:
    settings = Settings(
        model=str(tiny_model_path),
        engine="synthetic",
        served_model_name="synthetic",
        synthetic_tokens_per_second=2,  # 0.5 s between tokens
        sse_ping_seconds=0.2,
    )
    with run_gateway(build_engine(settings), settings) as running, httpx.Client(timeout=30) as client:
        body = {"model": "synthetic", "messages": [{"role": "user", "content": "go"}], "stream": True, "max_tokens": 3}
        raw = client.post(running.base_url + "/v1/chat/completions", json=body).content
    assert b": ping\n\n" in raw
    assert len(_frames(raw)) == 4  # role and three tokens, the pings between them
    assert raw.endswith(b"data: [DONE]\n\n")


def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(tiny_model_path: Path) -> None:
    settings = Settings(
        model=str(tiny_model_path), engine="synthetic", served_model_name="synthetic", sse_send_timeout_seconds=1.0
    )
    with run_gateway(build_engine(settings), settings) as running:
        port = int(running.base_url.rsplit(":", 1)[1])
        body = {
            "model": "synthetic",
            "messages": [{"role": "user", "content": "go"}],
            "stream": True,
            "max_tokens": 30000,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 5,
        }
        conn, _ = _stream_request(port, body, rcvbuf=4096)  # and never read the body
        deadline = time.monotonic() + 30
        while running.health()["active_requests"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running.health()["active_requests"] == 0  # the engine request was aborted
        conn.close()
