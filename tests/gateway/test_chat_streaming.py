"""Streaming chat completions from the real tiny model through a real uvicorn server.

Every test here uses the official ``openai`` client (or raw ``httpx`` where the SSE bytes
themselves are checked) against the shared session gateway.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from openai import AsyncOpenAI, OpenAI

from ..support.servers import RunningGateway

USER = [{"role": "user", "content": "Write a long story about a robot."}]


def test_tokens_arrive_while_the_engine_is_still_sampling(client: OpenAI, gateway: RunningGateway) -> None:
    """More than one content chunk arrives before the last token is sampled."""
    stream = client.chat.completions.create(
        model="tiny", messages=USER, stream=True, max_tokens=3000, extra_body={"ignore_eos": True}
    )
    content_chunks = 0
    seen_mid_generation = None
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            content_chunks += 1
            if content_chunks == 2:
                # Two chunks are in our hands: the engine must still be working on this request.
                seen_mid_generation = gateway.health()
        finish = choice.finish_reason or finish
    assert seen_mid_generation is not None
    assert seen_mid_generation["active_requests"] == 1
    assert content_chunks > 2
    assert finish == "length"


def test_sse_frames_follow_the_openai_chunk_format(gateway: RunningGateway) -> None:
    """Role chunk first, content deltas, a finish reason, the usage chunk with no choices, [DONE]."""
    body = {
        "model": "tiny",
        "messages": USER,
        "stream": True,
        "max_tokens": 12,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", gateway.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in response.iter_lines() if line]
    assert all(frame.startswith("data: ") for frame in frames)
    assert frames[-1] == "data: [DONE]"
    chunks = [orjson.loads(frame[6:]) for frame in frames[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])


def test_max_tokens_ends_with_length_and_usage_counts_real_tokens(client: OpenAI, gateway: RunningGateway) -> None:
    """Usage equals the real prompt length (rendered independently) and the sampled token count."""
    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        stream=True,
        max_completion_tokens=7,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    token_ids: list[int] = []
    usage = None
    finish = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            token_ids.extend(getattr(choice, "token_ids", None) or [])
            finish = choice.finish_reason or finish
    tokenizer = gateway.engine.tokenizer
    expected_prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert finish == "length"
    assert usage is not None
    assert usage.prompt_tokens == len(expected_prompt)
    assert usage.completion_tokens == len(token_ids) == 7
    assert usage.total_tokens == usage.prompt_tokens + 7


def test_stop_string_truncates_and_never_leaks(client: OpenAI) -> None:
    """A stop string cuts the content right before it, in streaming and non-streaming modes."""
    base = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].message.content or ""
    assert len(text) > 12, text
    stop = text[8:11]
    expected = text[: text.index(stop)]

    plain = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].message.content == expected
    assert plain.choices[0].finish_reason == "stop"

    streamed = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=40,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts, finish = [], None
    for chunk in streamed:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == expected
    assert finish == "stop"


def test_seeded_sampling_is_reproducible(client: OpenAI) -> None:
    """The same seed gives the same tokens; a different seed (almost surely) does not."""

    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=24, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
        )
        return reply.choices[0].message.content or ""

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_n_choices_stream_with_distinct_indexes(client: OpenAI) -> None:
    """n=3 streams three choices, each with its own finish reason."""
    stream = client.chat.completions.create(
        model="tiny", messages=USER, n=3, max_tokens=6, stream=True, seed=1, extra_body={"ignore_eos": True}
    )
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) > 1


@pytest.mark.anyio
async def test_async_client_streams_concurrently(async_client: AsyncOpenAI) -> None:
    """Eight concurrent async streams all complete, each with its own content."""
    import anyio

    results: dict[int, tuple[str, str | None]] = {}

    async def one(i: int) -> None:
        stream = await async_client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"Story number {i}"}],
            stream=True,
            max_tokens=16,
            seed=i,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        results[i] = (text, finish)

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert sorted(results) == list(range(8))
    assert all(finish == "length" for _, finish in results.values())


@pytest.mark.anyio
async def test_async_client_non_streaming(async_client: AsyncOpenAI) -> None:
    """A plain async completion returns a chat.completion with usage."""
    reply = await async_client.chat.completions.create(model="tiny", messages=USER, max_tokens=5)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 5


def test_models_health_and_metrics(client: OpenAI, gateway: RunningGateway) -> None:
    """/v1/models lists the served model; /metrics has latency histograms that moved."""
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, stream=True).close()
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    text = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    for name in (
        "gateway_time_to_first_token_seconds_count",
        "gateway_inter_token_latency_seconds_count",
        "gateway_completion_tokens_total",
        "gateway_active_streams",
    ):
        assert name in text
    ttft = next(line for line in text.splitlines() if line.startswith("gateway_time_to_first_token_seconds_count"))
    assert float(ttft.split()[-1]) >= 1
