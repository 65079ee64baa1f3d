"""One conformance suite for every engine (the shape of trio's ``check_one_way_stream``).

Each engine of :data:`~stream_gateway.engines.registry.ENGINES` that runs here is started on the
tiny model and held to the :class:`~stream_gateway.engines.Engine` protocol's promises: steps until
exactly one carries a finish reason, a logprob per id, ``max_tokens`` and stop ids honoured, top
alternatives when asked, a seed that repeats a draw, an abort that frees the request, concurrent
requests, a weight load that labels what follows, and statistics that count. ``vllm-http`` runs
against a gateway serving vLLM's token-in API in a thread; ``vllm`` needs a GPU
(tests/gateway/test_engine_vllm.py) and ``sglang-http`` speaks only to the SGLang stand-in
(tests/gateway/test_remote_engine.py), which cannot sample on its own.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from pathlib import Path

import anyio
import pytest

from stream_gateway import Settings
from stream_gateway.engines import Engine, EngineStep, SamplingParams, create_engine
from stream_gateway.engines.registry import ENGINES

from ..support.servers import RunningGateway, run_gateway

CONFORMING = ("transformers", "scripted", "synthetic", "vllm-http")
pytestmark = pytest.mark.anyio


def test_every_engine_that_runs_here_is_in_the_suite() -> None:
    """A new engine joins the suite when it joins the registry (or says here why it cannot)."""
    assert set(ENGINES) == {*CONFORMING, "vllm", "sglang-http"}


@pytest.fixture(scope="module")
def upstream(tiny_model_path: Path) -> Iterator[RunningGateway]:
    """A gateway on the transformers engine: vllm-http's server (vLLM's token-in API)."""
    settings = Settings(model=str(tiny_model_path), served_model_name="tiny")
    engine = create_engine("transformers", tiny_model_path, served_model_name="tiny")
    with run_gateway(engine, settings) as running:
        yield running


@pytest.fixture(params=CONFORMING)
async def engine(request: pytest.FixtureRequest, tiny_model_path: Path) -> AsyncIterator[Engine]:
    name: str = request.param
    options: dict[str, object] = {"served_model_name": "tiny"}
    if name == "vllm-http":
        options["upstreams"] = [request.getfixturevalue("upstream").base_url]
    async with create_engine(name, tiny_model_path, **options) as started:
        if name == "vllm-http":
            pool = started.upstreams
            assert pool is not None
            await _eventually(lambda: any(u.healthy for u in pool.upstream_list()), "a healthy server")
        yield started


async def _eventually(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.02)
    assert condition(), what


async def _run(engine: Engine, params: SamplingParams, prompt: list[int] | None = None) -> list[EngineStep]:
    ids = prompt or engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    return [step async for step in engine.generate("r-" + str(id(params)), ids, params)]


def _ids(steps: list[EngineStep]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


async def test_steps_end_with_exactly_one_finish_reason_and_a_logprob_per_id(engine: Engine) -> None:
    steps = await _run(engine, SamplingParams(max_tokens=12, temperature=1.0, seed=1))
    assert [s.finish_reason is not None for s in steps] == [False] * (len(steps) - 1) + [True]
    assert steps[-1].finish_reason in ("stop", "length")
    for step in steps:
        assert step.token_ids and len(step.logprobs) == len(step.token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in step.logprobs)
        assert all(0 <= t < len(engine.tokenizer) for t in step.token_ids)
        assert step.policy_version == engine.policy_version


async def test_max_tokens_is_a_hard_limit(engine: Engine) -> None:
    steps = await _run(engine, SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True, seed=2))
    assert len(_ids(steps)) == 5
    assert steps[-1].finish_reason == "length"


async def test_a_stop_id_ends_the_output_and_is_part_of_it(engine: Engine) -> None:
    free = _ids(await _run(engine, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    stop = free[2]
    first = free.index(stop)
    steps = await _run(engine, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=frozenset({stop})))
    assert _ids(steps) == free[: first + 1]
    assert steps[-1].finish_reason == "stop"


async def test_top_logprobs_are_given_when_asked_most_likely_first(engine: Engine) -> None:
    steps = await _run(engine, SamplingParams(max_tokens=4, temperature=1.0, top_logprobs=1, ignore_eos=True, seed=3))
    for step in steps:
        assert step.top_logprobs is not None and len(step.top_logprobs) == len(step.token_ids)
        for alternatives in step.top_logprobs:
            assert 1 <= len(alternatives) <= 1
            assert all(lp <= 0.0 for _, lp in alternatives)


async def test_a_seed_repeats_the_draw(engine: Engine) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=1234)
    first, second = await _run(engine, params), await _run(engine, params)
    assert _ids(first) == _ids(second)
    assert [lp for s in first for lp in s.logprobs] == pytest.approx([lp for s in second for lp in s.logprobs])


async def test_closing_the_iterator_aborts_the_request(engine: Engine) -> None:
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    before = engine.statistics()
    steps = engine.generate("leaves", ids, SamplingParams(max_tokens=5000, temperature=1.0, ignore_eos=True))
    async with aclosing(steps):
        async for _ in steps:
            break
    await _eventually(lambda: engine.statistics().active_requests == 0, "the request's end")
    after = engine.statistics()
    assert after.total_requests == before.total_requests + 1
    assert after.total_generated_tokens < before.total_generated_tokens + 5000


async def test_concurrent_requests_each_finish(engine: Engine) -> None:
    results: dict[int, list[EngineStep]] = {}

    async def one(i: int) -> None:
        results[i] = await _run(engine, SamplingParams(max_tokens=6 + i, temperature=1.0, ignore_eos=True, seed=i))

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    assert [len(_ids(results[i])) for i in range(4)] == [6, 7, 8, 9]


async def test_a_weight_load_labels_what_follows(engine: Engine, tiny_model_path: Path) -> None:
    report = await engine.load_weights(str(tiny_model_path), engine.policy_version + 1)
    assert report.policy_version == engine.policy_version
    steps = await _run(engine, SamplingParams(max_tokens=3, temperature=1.0, seed=4))
    assert {s.policy_version for s in steps} == {report.policy_version}
