"""Routed experts on ``tiny-moe``: recorded as the engine computes them, kept per position, served
compactly, and replayed by a trainer (docs/moe.md).

Every check compares with an independent forward pass of the same model over the same ids
(``output_router_logits``), never with what the gateway itself says.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import resolve_model
from stream_gateway.moe import RouterCapture, decode_routes, replay_routes

from ..support.moe import free_routes, same_experts
from ..support.servers import RunningGateway, run_gateway

MODEL = "tiny-moe"
HEADERS = {"authorization": "Bearer sk-moe"}
# tiny-moe's weights are random: an enum keeps the forced call's arguments short.
READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": ["README.md"]}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def moe_path() -> Path:
    return Path(resolve_model(MODEL))


@pytest.fixture(scope="module")
def moe_gateway(moe_path: Path) -> Iterator[RunningGateway]:
    settings = Settings(model=str(moe_path), served_model_name=MODEL, max_batch_size=8)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture(scope="module")
def reference(moe_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


def _session(gateway: RunningGateway, session: str, include: str | None = "routed_experts") -> httpx.Response:
    params = {"include": include} if include else {}
    return httpx.get(f"{gateway.base_url}/sessions/{session}", params=params, headers=HEADERS, timeout=30)


def _conversation(gateway: RunningGateway, session: str) -> None:
    """A tool loop (a forced call, its result), then a second user message; the last turn asks for n=2."""
    with OpenAI(base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key="sk-moe", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "What is in the README?"}]
        call = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[READ_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "read"}},
            max_tokens=60,
        ).choices[0]
        assert call.finish_reason == "tool_calls", call
        messages += [
            call.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.message.tool_calls[0].id, "content": "The secret is lighthouse."},  # type: ignore[index]
        ]
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[READ_TOOL], max_tokens=16)  # type: ignore[list-item]
        messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again?"}]
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[READ_TOOL],  # type: ignore[list-item]
            max_tokens=16,
            n=2,
            temperature=1.0,
        )


def test_every_position_is_routed_as_an_independent_forward_pass_routes_it(
    moe_gateway: RunningGateway, reference: Any
) -> None:
    session = f"moe{secrets.token_hex(4)}"
    _conversation(moe_gateway, session)
    body = _session(moe_gateway, session).json()
    turns = {t["turn_id"]: t for t in body["turns"]}
    assert len(turns) == 4 and sum(t["parent_id"] is None for t in turns.values()) == 1
    agree = total = 0
    for turn in turns.values():
        routes = decode_routes(turn["routed_experts"])
        ids = turn["prompt_ids"] + turn["output_ids"]
        assert routes.dtype == np.uint8 and routes.shape == (len(ids) - 1, 3, 2)
        same = same_experts(routes, free_routes(reference, ids))
        agree, total = agree + int(same.sum()), total + same.size
        parent = turns.get(turn["parent_id"])
        if parent is not None:
            # The rows of the parent's positions are the parent's own, recorded when they decoded.
            inherited = decode_routes(parent["routed_experts"])
            assert np.array_equal(routes[: len(inherited)], inherited)
    assert agree / total >= 0.999, f"{total - agree} of {total} (position, layer) routes differ"
    for chain in body["chains"]:
        leaf = turns[chain["turn_ids"][-1]]
        assert chain["routed_experts"] == leaf["routed_experts"]
        assert decode_routes(chain["routed_experts"]).shape[0] == len(chain["token_ids"]) - 1
    # Each continuation's prefill ran the ancestors' positions again; the gateway counted how many
    # of those rows disagreed with the recorded ones (and kept the recorded ones).
    metrics = httpx.get(f"{moe_gateway.base_url}/metrics").text
    compared = _metric(metrics, "gateway_route_rows_compared_total")
    assert compared > 0 and _metric(metrics, "gateway_route_rows_disagreeing_total") <= compared * 0.001


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_replaying_the_recorded_routes_reproduces_the_recorded_logprobs(
    moe_gateway: RunningGateway, reference: Any, moe_path: Path
) -> None:
    session = f"replay{secrets.token_hex(4)}"
    # Unconstrained turns (a forced call's logprobs are its grammar's masked ones: test_constrained.py).
    with OpenAI(base_url=f"{moe_gateway.base_url}/sessions/{session}/v1", api_key="sk-moe", max_retries=0) as client:
        messages: list[Any] = []
        for question in ("What is in the README?", "And then?", "Why?"):
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=1.0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    [chain] = _session(moe_gateway, session).json()["chains"]
    ids, mask, recorded = chain["token_ids"], chain["mask"], torch.tensor(chain["logprobs"])
    routes = decode_routes(chain["routed_experts"])
    sampled = torch.tensor(mask[1:], dtype=torch.bool)

    def logprobs(model: Any, forced: np.ndarray | None) -> torch.Tensor:
        inputs = torch.tensor([ids[:-1]])
        with torch.no_grad():
            if forced is None:
                logits = model(input_ids=inputs).logits[0]
            else:
                with replay_routes(model, forced):
                    logits = model(input_ids=inputs).logits[0]
        return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    # The rollout's weights: replay gives back every sampled token's logprob.
    torch.testing.assert_close(logprobs(reference, routes)[sampled], recorded[1:][sampled], atol=1e-5, rtol=0)
    # An update that moves the routers (what a training step does): free routing now picks other
    # experts for some positions; replay keeps every choice the rollout made.
    moved = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in moved.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    free_now = free_routes(moved, ids)
    changed = 1 - same_experts(free_now, routes).mean()
    assert changed > 0.01, changed
    capture = RouterCapture.attach(moved)
    assert capture is not None
    with torch.no_grad(), replay_routes(moved, routes):
        moved(input_ids=torch.tensor([ids[:-1]]))
    assert np.array_equal(capture.take()[0], routes)  # the forced experts, all of them
    capture.detach()
    # Pinning the experts changes what the moved model computes (the routing weights are the new
    # routers' own, as in Megatron's R3: replay fixes which experts, not how much of each).
    free, replayed = logprobs(moved, None), logprobs(moved, routes)
    assert (free - replayed)[sampled].abs().max() > 1e-3


def test_a_dense_model_has_no_routes_to_give(gateway: RunningGateway, moe_gateway: RunningGateway) -> None:
    with OpenAI(base_url=f"{gateway.base_url}/sessions/dense1/v1", api_key="sk-moe", max_retries=0) as client:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    refused = _session(gateway, "dense1")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "include" and "no experts" in refused.json()["error"]["message"]
    assert "routed_experts" not in _session(gateway, "dense1", include=None).json()["turns"][0]
    unknown = _session(moe_gateway, "dense1", include="routed_experts,everything")
    assert unknown.status_code == 400 and "everything" in unknown.json()["error"]["message"]
