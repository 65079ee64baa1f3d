"""The ``vllm`` engine, for real: vLLM's ``AsyncLLM`` on a CUDA GPU with the tiny test model.

Runs only where vLLM is installed and a CUDA GPU exists; everywhere else the module skips before
importing anything GPU-related. Nothing is faked: the reference log-probabilities come from a
transformers forward pass of the same checkpoint over the same tokens, in float32 on the same GPU.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    _needs = "a CUDA GPU" if importlib.util.find_spec("vllm") else "a CUDA GPU and vLLM"
    pytest.skip(f"needs {_needs} (torch.cuda.is_available() is False)", allow_module_level=True)
with warnings.catch_warnings():
    # vLLM's import warns (deprecations in its dependencies); pytest would turn that into an error.
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'stream-gateway[vllm]'")

from transformers import AutoConfig, AutoModelForCausalLM

from stream_gateway.engines._base import EngineStep, SamplingParams
from stream_gateway.engines.vllm import VLLMEngine
from stream_gateway.models import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    # vLLM and its dependencies warn during start-up and shutdown in ways we cannot fix: show them.
    pytest.mark.filterwarnings("default"),
]

TOLERANCE = 1e-3  # vLLM's kernels vs transformers' eager attention, both float32


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # AsyncLLM runs on asyncio only


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    context = int(getattr(AutoConfig.from_pretrained(tiny_model), "max_position_embeddings", 512))
    vllm_engine = VLLMEngine(
        str(tiny_model),
        served_model_name="tiny",
        max_model_len=min(512, context),
        gpu_memory_utilization=0.3,
        max_logprobs=5,
        engine_kwargs={"dtype": "float32", "enforce_eager": True, "seed": 0},
    )
    async with vllm_engine:
        yield vllm_engine


@pytest.fixture(scope="module")
def reference(tiny_model: Path, engine: VLLMEngine) -> torch.nn.Module:
    # Depends on ``engine`` so vLLM starts before this process touches CUDA (vLLM would
    # otherwise have to switch its worker processes to ``spawn``).
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model.to("cuda").eval()


@pytest.fixture(scope="module")
def prompt(engine: VLLMEngine) -> list[int]:
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert ids
    return list(ids)


async def collect(engine: VLLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[EngineStep]:
    return [step async for step in engine.generate(request_id, prompt, params)]


def reference_logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of the model's next-token logits at each generated position: [len(generated), V]."""
    ids = torch.tensor([prompt + generated], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def flatten(steps: list[EngineStep]) -> tuple[list[int], list[float]]:
    return [t for s in steps for t in s.token_ids], [lp for s in steps for lp in s.logprobs]


async def test_sampled_ids_stream_with_the_models_logprobs(
    engine: VLLMEngine, reference: torch.nn.Module, prompt: list[int]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, seed=7, top_logprobs=3, ignore_eos=True)
    steps = await collect(engine, "sampled", prompt, params)

    assert len(steps) > 1, "tokens must stream as several deltas, not one final output"
    assert all(len(s.token_ids) == len(s.logprobs) for s in steps)
    assert [s.finish_reason for s in steps[:-1]] == [None] * (len(steps) - 1)
    assert steps[-1].finish_reason == "length"
    ids, logprobs = flatten(steps)
    assert len(ids) == 16

    expected = reference_logprobs(reference, prompt, ids)
    rows = torch.arange(len(ids), device="cuda")
    sampled = expected[rows, torch.tensor(ids, device="cuda")].cpu()
    torch.testing.assert_close(torch.tensor(logprobs), sampled, atol=TOLERANCE, rtol=0)

    top = [pairs for s in steps for pairs in (s.top_logprobs or ())]
    assert len(top) == len(ids)
    ref_top = torch.topk(expected, k=3, dim=-1).values.cpu()
    for i, pairs in enumerate(top):
        values = [lp for _, lp in pairs]
        assert values == sorted(values, reverse=True), "top logprobs must be most likely first"
        torch.testing.assert_close(torch.tensor(values), ref_top[i], atol=TOLERANCE, rtol=0)


async def test_greedy_is_deterministic_and_takes_the_argmax(
    engine: VLLMEngine, reference: torch.nn.Module, prompt: list[int]
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first, logprobs = flatten(await collect(engine, "greedy-1", prompt, params))
    second, _ = flatten(await collect(engine, "greedy-2", prompt, params))
    assert first == second

    expected = reference_logprobs(reference, prompt, first)
    rows = torch.arange(len(first), device="cuda")
    chosen = expected[rows, torch.tensor(first, device="cuda")]
    # The argmax up to float32 ties; the logprobs of greedy decoding are the raw distribution's.
    assert bool((chosen >= expected.max(dim=-1).values - TOLERANCE).all())
    torch.testing.assert_close(torch.tensor(logprobs), chosen.cpu(), atol=TOLERANCE, rtol=0)


async def test_a_stop_token_ends_with_stop_and_is_returned(engine: VLLMEngine, prompt: list[int]) -> None:
    greedy, _ = flatten(await collect(engine, "greedy-3", prompt, SamplingParams(max_tokens=8, temperature=0.0)))
    stop_id = greedy[min(2, len(greedy) - 1)]
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=frozenset({stop_id}))
    steps = await collect(engine, "stopped", prompt, params)
    ids, _ = flatten(steps)
    assert steps[-1].finish_reason == "stop"
    assert ids == greedy[: greedy.index(stop_id) + 1]


async def test_max_tokens_ends_with_length(engine: VLLMEngine, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    steps = await collect(engine, "short", prompt, params)
    assert len(flatten(steps)[0]) == 3
    assert steps[-1].finish_reason == "length"


async def test_closing_the_iterator_aborts_the_request(engine: VLLMEngine, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=5, ignore_eos=True)
    before = engine.statistics()
    steps = engine.generate("closed-early", prompt, params)
    first = await anext(steps)
    assert first.token_ids
    assert engine.statistics().active_requests == before.active_requests + 1
    await steps.aclose()

    after = engine.statistics()
    assert after.active_requests == before.active_requests == 0
    assert after.waiting_requests == 0
    assert after.total_requests == before.total_requests + 1
    assert after.total_generated_tokens < before.total_generated_tokens + 400
    # The engine is still healthy, and the same request id can be used again once aborted.
    again = await collect(engine, "closed-early", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert again[-1].finish_reason is not None


async def test_load_weights_reloads_in_place_and_bumps_the_policy_version(
    engine: VLLMEngine, tiny_model: Path, prompt: list[int]
) -> None:
    # Last in this module: the module's engine serves policy version 1 afterwards.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before, _ = flatten(await collect(engine, "before-reload", prompt, params))
    # The same checkpoint again: vLLM's pause(keep) / reload_weights(weights_path) / prefix-cache
    # reset / resume path runs for real, and greedy decoding must not change.
    report = await engine.load_weights(str(tiny_model), policy_version=1)
    assert (report.policy_version, report.previous_version, engine.policy_version) == (1, 0, 1)
    steps = await collect(engine, "after-reload", prompt, params)
    assert flatten(steps)[0] == before
    assert {s.policy_version for s in steps} == {1}
