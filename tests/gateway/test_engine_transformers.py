"""The transformers engine on the real tiny model: batching is exact, aborts free rows."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from stream_gateway._errors import WeightsRejected
from stream_gateway.engines import EngineStep, SamplingParams
from stream_gateway.engines.transformers import TransformersEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
async def engine(tiny_model_path: Path) -> AsyncIterator[TransformersEngine]:
    async with TransformersEngine(tiny_model_path, max_batch_size=8) as e:
        yield e


def _per_token(steps: list[EngineStep]) -> list[EngineStep]:
    """One step per token: the engine hands over the steps that waited for its consumer as one."""
    return [
        EngineStep(
            (token,),
            (step.logprobs[j],),
            (step.top_logprobs[j],) if step.top_logprobs is not None else None,
            step.finish_reason if j == len(step.token_ids) - 1 else None,
            step.policy_version,
            cached_prompt_tokens=step.cached_prompt_tokens if j == len(step.token_ids) - 1 else None,
        )
        for step in steps
        for j, token in enumerate(step.token_ids)
    ]


async def _collect(engine: TransformersEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[EngineStep]:
    return _per_token([step async for step in engine.generate(rid, prompt, params)])


async def test_concurrent_requests_equal_one_at_a_time(engine: TransformersEngine, tiny_model_path: Path) -> None:
    """Rows joining a running batch (different prompt lengths, left padding) decode exactly as alone."""
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = [await _collect(engine, f"a{i}", p, params) for i, p in enumerate(prompts)]
    together: dict[int, list[EngineStep]] = {}
    peak = 0

    async def run(i: int) -> None:
        nonlocal peak
        steps = []
        async for step in engine.generate(f"b{i}", prompts[i], params):
            peak = max(peak, engine.statistics().active_requests)
            steps.append(step)
        together[i] = _per_token(steps)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(run, i)
    assert peak > 1, "requests were never batched together"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ids_alone = [s.token_ids[0] for s in alone[i]]
        ids_together = [s.token_ids[0] for s in together[i]]
        assert ids_together == ids_alone
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + ids_together])).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).max(-1).values
        torch.testing.assert_close(torch.tensor([s.logprobs[0] for s in together[i]]), reference, atol=2e-4, rtol=0)
        assert together[i][-1].finish_reason == "length"
        assert all(s.finish_reason is None for s in together[i][:-1])


async def test_stop_token_ids_end_with_stop(engine: TransformersEngine) -> None:
    free = await _collect(engine, "f", [9, 9, 9], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    target = free[4].token_ids[0]
    first = next(i for i, s in enumerate(free) if s.token_ids[0] == target)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=frozenset({target}))
    steps = await _collect(engine, "s", [9, 9, 9], params)
    assert [s.token_ids[0] for s in steps] == [s.token_ids[0] for s in free[: first + 1]]
    assert steps[-1].finish_reason == "stop"


async def test_closing_the_iterator_frees_the_row(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    steps = engine.generate("long", [1, 2, 3], params)
    async for i, _ in _enumerate(steps):
        if i == 5:
            break
    await steps.aclose()
    with anyio.fail_after(10):
        # The counter belongs to the worker thread; there is no event to wait on.
        while engine.statistics().active_requests:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert engine.statistics().total_generated_tokens < 1000


async def test_weights_reload_bumps_the_policy_version(
    engine: TransformersEngine, tiny_model_path: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    state = {k: v * 1.5 if k.endswith("norm.weight") else v for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to the embeddings
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, top_logprobs=1)
    before = await _collect(engine, "w0", [4, 5, 6], params)
    await engine.load_weights(str(tmp_path), policy_version=3)
    after = await _collect(engine, "w1", [4, 5, 6], params)
    assert engine.policy_version == 3
    assert [s.logprobs for s in before] != [s.logprobs for s in after]
    with pytest.raises(WeightsRejected, match=r"no \*\.safetensors"):
        await engine.load_weights(str(tmp_path / "missing"), policy_version=4)
    assert engine.policy_version == 3


async def _enumerate(steps: AsyncIterator[EngineStep]) -> AsyncIterator[tuple[int, EngineStep]]:
    i = 0
    async for step in steps:
        yield i, step
        i += 1


async def test_a_bad_prompt_fails_its_request_only(engine: TransformersEngine) -> None:
    from stream_gateway import EngineError

    with pytest.raises(EngineError):
        await _collect(engine, "bad", [10**9], SamplingParams(max_tokens=3))
    steps = await _collect(engine, "good", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(steps) == 3
    assert engine.statistics().active_requests == 0


async def test_rows_in_flight_continue_across_a_weight_update_with_exact_logprobs(
    engine: TransformersEngine, tiny_model_path: Path
) -> None:
    """Rows of different lengths decode across an update: none ends early, each step is labelled with
    the version that sampled it, and every logprob is a forward pass of that version's weights over
    the whole sequence (the KV cache of the rows was recomputed, left-padded, under the new weights)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(5)
    updated = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    updated.pop("lm_head.weight", None)  # tied to the embeddings
    prompts = [[7 + i] * (4 + 9 * i) for i in range(4)]
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=3, ignore_eos=True)
    steps: dict[int, list[EngineStep]] = {i: [] for i in range(len(prompts))}
    started = anyio.Event()

    async def run(i: int) -> None:
        async for step in engine.generate(f"u{i}", prompts[i], params):
            steps[i].append(step)
            if all(steps.values()):
                started.set()

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(run, i)
        await started.wait()
        report = await engine.update_weights(updated, policy_version=1)
    assert report.in_flight >= 2 and report.previous_version == 0 and report.pause_s >= report.copy_s > 0
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    reference.load_state_dict(updated, strict=False)
    models = {0: model, 1: reference}
    switched = 0
    steps = {i: _per_token(steps[i]) for i in steps}
    for i, prompt in enumerate(prompts):
        versions = [s.policy_version for s in steps[i]]
        assert len(versions) == 400 and versions == sorted(versions)  # none cut short, versions only go up
        switched += 0 in versions and 1 in versions
        output = [s.token_ids[0] for s in steps[i]]
        with torch.inference_mode():
            for version, weights in models.items():
                logits = weights(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
                predicted = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
                own = torch.tensor([v == version for v in versions])
                recorded = torch.tensor([s.logprobs[0] for s in steps[i]])
                torch.testing.assert_close(predicted[own], recorded[own], atol=1e-4, rtol=0)
    assert switched >= 2, "the update landed outside the rows' generations"


async def test_keeping_the_cache_pauses_for_the_copy_alone(tiny_model_path: Path) -> None:
    """``--kv-cache-on-update keep``: rows continue, labelled with the new version, but the tokens they
    sample after the update are not a forward pass of the new weights (the cache is the old one's)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(9)
    updated = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    updated.pop("lm_head.weight", None)
    prompt = [11] * 40
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=4, ignore_eos=True)
    steps: list[EngineStep] = []
    async with TransformersEngine(tiny_model_path, recompute_on_update=False) as engine:
        iterator = engine.generate("k", prompt, params)
        steps.append(await anext(iterator))
        report = await engine.update_weights(updated, policy_version=1)
        steps.extend([step async for step in iterator])
    steps = _per_token(steps)
    assert report.in_flight == 1 and len(steps) == 300
    versions = [s.policy_version for s in steps]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    model.load_state_dict(updated, strict=False)
    output = [s.token_ids[0] for s in steps]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    predicted = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    recorded = torch.tensor([s.logprobs[0] for s in steps])
    new = torch.tensor([v == 1 for v in versions])
    assert (predicted[new] - recorded[new]).abs().max() > 1e-3  # what recompute exists for


async def test_a_prompt_continuing_an_earlier_one_prefills_only_its_new_tokens(tiny_model_path: Path) -> None:
    """An agent's next turn (the last prompt, its answer, a tool result) borrows the last prompt's
    keys and values from the prefix cache; its logprobs are still a forward pass over the whole
    sequence, and a weight update leaves nothing to borrow."""
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(10, 2000, (300,), generator=generator).tolist()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    async with TransformersEngine(tiny_model_path, prefix_cache_mb=64) as engine:
        turn = await _collect(engine, "t1", first, params)
        assert turn[-1].cached_prompt_tokens == 0
        answer = [s.token_ids[0] for s in turn]
        second = [*first, *answer, *torch.randint(10, 2000, (40,), generator=generator).tolist()]
        turn = await _collect(engine, "t2", second, params)
        assert turn[-1].cached_prompt_tokens == len(first)
        output = [s.token_ids[0] for s in turn]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([second + output])).logits[0, len(second) - 1 : -1]
        predicted = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([s.logprobs[0] for s in turn]), predicted, atol=2e-4, rtol=0)
        # New weights (the same values, a new version): the kept keys are not theirs.
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        await engine.update_weights(state, policy_version=1)
        again = await _collect(engine, "t3", [*second, *output, 7], params)
        assert again[-1].cached_prompt_tokens == 0
    async with TransformersEngine(tiny_model_path, prefix_cache_mb=0) as engine:  # --prefix-cache-mb 0: off
        await _collect(engine, "o1", first, params)
        assert (await _collect(engine, "o2", second, params))[-1].cached_prompt_tokens == 0
