"""The transformers engine on ``tiny-moe``: every step carries the routes of the positions it ran,
batched rows are routed as alone, and a turn crossing a weight update keeps each position's route
from the version that computed it (docs/moe.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from stream_gateway.engines import EngineStep, ExpertShape, SamplingParams
from stream_gateway.engines.transformers import TransformersEngine
from stream_gateway.models import resolve_model

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def moe_path() -> Path:
    return Path(resolve_model("tiny-moe"))


@pytest.fixture
async def engine(moe_path: Path) -> AsyncIterator[TransformersEngine]:
    async with TransformersEngine(moe_path, max_batch_size=8) as e:
        yield e


def _free_routes(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    return np.stack([logits.topk(2, dim=-1).indices.numpy() for logits in out.router_logits], axis=1)[:-1]


def _per_position(prompt: list[int], steps: list[EngineStep]) -> tuple[np.ndarray, list[int]]:
    """The rows of the whole output, and per row the version of the step that carried it."""
    rows, versions = [], []
    for step in steps:
        assert step.routes is not None and step.routes.dtype == np.uint8
        rows.append(step.routes)
        versions += [step.policy_version] * len(step.routes)
    routes = np.concatenate(rows)
    output = sum(len(s.token_ids) for s in steps)
    assert routes.shape == (len(prompt) + output - 1, 3, 2)  # every position the model ran, once
    return routes, versions


async def test_a_dense_model_carries_no_routes(tiny_model_path: Path) -> None:
    async with TransformersEngine(tiny_model_path) as dense:
        assert dense.experts is None
        steps = [s async for s in dense.generate("d", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
    assert all(s.routes is None for s in steps)


async def test_batched_rows_are_routed_as_each_alone(engine: TransformersEngine, moe_path: Path) -> None:
    assert engine.experts == ExpertShape(layers=3, top_k=2, num_experts=8)
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    prompts = [[11 + i] * (3 + 7 * i) for i in range(4)]  # different lengths: left padding in the batch
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=2, ignore_eos=True)
    results: dict[int, list[EngineStep]] = {}

    async def run(i: int) -> None:
        results[i] = [s async for s in engine.generate(f"r{i}", prompts[i], params)]

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(run, i)
    agree = total = 0
    for i, prompt in enumerate(prompts):
        routes, _ = _per_position(prompt, results[i])
        output = [t for s in results[i] for t in s.token_ids]
        same = (np.sort(routes, -1) == np.sort(_free_routes(model, prompt + output), -1)).all(-1)
        agree, total = agree + int(same.sum()), total + same.size
    assert agree / total >= 0.999, (total - agree, total)


async def test_a_turn_crossing_an_update_keeps_each_versions_routes(engine: TransformersEngine, moe_path: Path) -> None:
    """Rows computed before the update are v0's routing; after it (the cache recomputed under v1),
    v1's: each equals that version's forward pass over the sequence at that position."""
    old = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(9)
    updated = {
        k: v + 0.3 * torch.randn(v.shape, generator=generator)
        for k, v in old.state_dict().items()
        if k.endswith("mlp.gate.weight")  # the routers move: routing visibly changes
    }
    new = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    new.load_state_dict(updated, strict=False)
    prompts = [[21 + i] * (5 + 6 * i) for i in range(3)]
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=4, ignore_eos=True)
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
        await engine.update_weights(updated, policy_version=1)
    crossed = 0
    for i, prompt in enumerate(prompts):
        routes, versions = _per_position(prompt, steps[i])
        output = [t for s in steps[i] for t in s.token_ids]
        by_version = {0: _free_routes(old, prompt + output), 1: _free_routes(new, prompt + output)}
        crossed += len(set(versions)) == 2
        for version, free in by_version.items():
            mine = np.array(versions) == version
            same = (np.sort(routes[mine], -1) == np.sort(free[mine], -1)).all(-1)
            assert same.mean() >= 0.999, (i, version, int((~same).sum()), same.size)
        # The update moved the routing: the other version would have routed some positions elsewhere.
        before = np.array(versions) == 0
        assert not (np.sort(routes[before], -1) == np.sort(by_version[1][before], -1)).all()
    assert crossed >= 2, "the update landed outside the turns"
