"""vLLM's token-in API on the gateway: ``POST /v1/completions`` with token-id prompts.

Driven with the official ``openai`` client (its ``completions`` resource, an unmodified
third-party token-in client; vLLM's extensions go in ``extra_body`` and come back as extra
fields) and raw httpx for the wire shapes. The expected field sets are vLLM's own response
models (see ``VLLM_*`` below and ``docs/http-api.md``).
"""

from __future__ import annotations

import base64
import io
import itertools
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import resolve_model

from ..support.fidelity import assert_chain_logprobs
from ..support.moe import free_routes
from ..support.servers import RunningGateway, run_gateway

# vLLM's response models and how it writes them, field by field: vLLM 0.33.0 (the PyPI wheel,
# commit g4ba787ec9), vllm/entrypoints/openai/completion/{protocol,serving}.py. Streamed chunks are
# ``model_dump_json(exclude_unset=True)`` of models built with these keys set (null when not asked
# for); the usage chunk drops nulls; non-streamed bodies are ``model_dump()``: every field, nulls
# included. The same sets are asserted exactly here.
VLLM_STREAM_RESPONSE = {"id", "object", "created", "model", "choices", "kv_transfer_params"}
VLLM_STREAM_CHOICE = {
    "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids", "weight_versions",
}  # fmt: skip
VLLM_USAGE_CHUNK = {"id", "object", "created", "model", "choices", "usage"}
VLLM_RESPONSE = {
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
    "kv_transfer_params", "ec_transfer_params", "metrics",
}  # fmt: skip
VLLM_CHOICE = {
    "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids",
    "routed_experts", "weight_versions",
}  # fmt: skip
VLLM_LOGPROBS = {"text_offset", "token_logprobs", "tokens", "top_logprobs"}


@pytest.fixture(scope="module")
def reference_model(tiny_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _post(gateway: RunningGateway, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(gateway.base_url + path, json=body, timeout=60)


def _frames(response: httpx.Response) -> list[dict[str, Any]]:
    frames = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            frames.append(orjson.loads(line[6:]))
    assert response.text.rstrip().endswith("data: [DONE]")
    return frames


def test_the_openai_client_completes_a_token_prompt_with_ids_and_logprobs(client: OpenAI, reference_model: Any) -> None:
    prompt = [1, 85, 741, 201, 1462, 941]
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=3, logprobs=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    extra = choice.model_extra or {}
    assert extra["prompt_token_ids"] == prompt
    ids = extra["token_ids"]
    assert len(ids) == reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens == len(prompt)  # type: ignore[union-attr]
    assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 8
    assert all(len(top) == 3 or len(top) == 2 for top in choice.logprobs.top_logprobs or [])
    # The recorded logprobs are those of a forward pass (temperature 1: the model's own distribution).
    mask = [0] * len(prompt) + [1] * len(ids)
    assert_chain_logprobs(
        reference_model, prompt + ids, mask, [0.0] * len(prompt) + list(choice.logprobs.token_logprobs or [])
    )
    assert (
        choice.text
        == client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=3).choices[0].text
    )  # seeded: the same text, with or without the extras


def test_streamed_chunks_have_vllms_fields_and_add_up_to_the_whole(gateway: RunningGateway) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    frames = _frames(_post(gateway, body))
    *chunks, usage = frames
    assert set(usage) == VLLM_USAGE_CHUNK
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    for chunk in chunks:
        assert set(chunk) == VLLM_STREAM_RESPONSE
        assert chunk["object"] == "text_completion"
        (choice,) = chunk["choices"]
        assert set(choice) == VLLM_STREAM_CHOICE, set(choice) ^ VLLM_STREAM_CHOICE
        assert set(choice["logprobs"]) == VLLM_LOGPROBS
        assert (
            len(choice["token_ids"]) == len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["token_logprobs"])
        )
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    whole = _post(gateway, {**body, "stream": False, "stream_options": None}).json()
    assert set(whole) == VLLM_RESPONSE
    assert set(whole["choices"][0]) == VLLM_CHOICE
    assert whole["choices"][0]["token_ids"] == streamed  # greedy: the same ids either way
    assert whole["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in chunks)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # vLLM's running sum
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["weight_versions"] is None for c in chunks)  # not asked for
    assert whole["usage"]["prompt_tokens_details"] is None and whole["choices"][0]["routed_experts"] is None
    plain = _frames(_post(gateway, {**body, "return_token_ids": False, "logprobs": None}))[:-1]
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["logprobs"] is None for c in plain)


def test_weight_versions_say_which_weights_sampled_which_tokens(gateway: RunningGateway) -> None:
    """vLLM's ``return_weight_versions``: spans on each choice's last chunk, and on whole choices."""
    # Sampled at temperature 1, so EOS could end a choice early: ``ignore_eos`` keeps both at six tokens.
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "n": 2, "return_weight_versions": True,
            "ignore_eos": True, "stream": True}  # fmt: skip
    chunks = _frames(_post(gateway, body))
    version = str(gateway.health()["policy_version"])
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert all(c["weight_versions"] is None for c in mine[:-1])
        assert mine[-1]["weight_versions"] == [{"version": version, "start": 0, "end": 6}]
    whole = _post(gateway, {**body, "stream": False}).json()
    assert [c["weight_versions"] for c in whole["choices"]] == [[{"version": version, "start": 0, "end": 6}]] * 2


def test_tokens_as_token_ids_and_string_and_batched_prompts(gateway: RunningGateway) -> None:
    body = {"model": "tiny", "prompt": [[9, 10, 11], [12, 13]], "n": 2, "max_tokens": 3, "logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}  # fmt: skip
    reply = _post(gateway, body).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]  # prompt i's choices are i*n .. i*n+n-1
    assert [c["prompt_token_ids"] for c in reply["choices"]] == [[9, 10, 11]] * 2 + [[12, 13]] * 2
    assert reply["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 12,
        "total_tokens": 17,
        "prompt_tokens_details": None,
    }
    for choice in reply["choices"]:
        tokens = choice["logprobs"]["tokens"]
        assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]
        for sampled, top in zip(tokens, choice["logprobs"]["top_logprobs"], strict=True):
            assert sampled in top and all(k.startswith("token_id:") for k in top)
        # Offsets count the ``token_id:N`` strings, as vLLM's do.
        assert choice["logprobs"]["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    tokenizer = gateway.engine.tokenizer
    texts = _post(gateway, {"model": "tiny", "prompt": ["hello there", "bye"], "max_tokens": 2,
                            "return_token_ids": True}).json()  # fmt: skip
    assert [c["prompt_token_ids"] for c in texts["choices"]] == [
        tokenizer.encode("hello there"),
        tokenizer.encode("bye"),
    ]
    mixed = _post(gateway, {"model": "tiny", "prompt": ["hello", [1, 2]]})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"


def test_a_prompt_extending_a_turn_continues_its_session(gateway: RunningGateway) -> None:
    """Token-in turns chain by exact id prefix, within a named session or found automatically."""
    prompt = [3, 1, 4, 1, 5, secrets.randbelow(1000) + 20, 9, 2, 6]
    first = _post(gateway, {"model": "tiny", "prompt": prompt, "max_tokens": 4, "return_token_ids": True})
    session_id = first.headers["x-session-id"]
    output = first.json()["choices"][0]["token_ids"]
    follow = prompt + output + [7, 7, 7]
    second = _post(gateway, {"model": "tiny", "prompt": follow, "max_tokens": 4, "return_token_ids": True})
    assert second.headers["x-session-id"] == session_id  # found by prefix, no session id given
    unrelated = _post(gateway, {"model": "tiny", "prompt": [*prompt[:-1], 8, 8], "max_tokens": 2})
    assert unrelated.headers["x-session-id"] != session_id
    turns = httpx.get(f"{gateway.base_url}/sessions/{session_id}").json()["turns"]
    assert [t["parent_id"] for t in turns] == [None, turns[0]["turn_id"]]
    assert turns[1]["reused_prompt_tokens"] == len(prompt) + len(output)
    assert turns[1]["prompt_ids"] == follow
    # Within a named session, the same rule.
    named = f"tok{secrets.token_hex(4)}"
    path = f"/sessions/{named}/v1/completions"
    a = _post(gateway, {"model": "tiny", "prompt": prompt, "max_tokens": 3, "return_token_ids": True}, path).json()
    # vLLM's own request field ``session_id`` names the session too.
    follow_up = {"model": "tiny", "prompt": prompt + a["choices"][0]["token_ids"] + [1], "max_tokens": 2}
    assert _post(gateway, {**follow_up, "session_id": named}).headers["x-session-id"] == named
    named_turns = httpx.get(f"{gateway.base_url}/sessions/{named}").json()["turns"]
    assert named_turns[1]["parent_id"] == named_turns[0]["turn_id"]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"prompt": [1, 2], "echo": True}, 400, "echo", "unsupported_parameter"),
        ({"prompt": [1, 10**9]}, 400, "prompt", None),
        ({"prompt": []}, 400, "prompt", None),
        ({"prompt": [1, 2], "max_tokens": 10**6}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": [1, 2], "logprobs": 21}, 400, "logprobs", None),
        ({"prompt": [1, 2], "model": "other"}, 404, "model", "model_not_found"),
        ({"prompt": [1, 2], "frequency_penalty": 0.5}, 400, "frequency_penalty", "unsupported_parameter"),
        ({"prompt": [1, 2], "bogus": 1}, 400, "bogus", None),
        ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options", None),
        ({"prompt": [1, 2], "stream_interval": 0}, 400, "stream_interval", None),
    ],
)
def test_bad_token_in_requests_get_openai_errors(
    gateway: RunningGateway, body: dict[str, Any], status: int, param: str, code: str | None
) -> None:
    response = _post(gateway, {"model": "tiny", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code, error


def test_a_front_asking_for_a_stream_interval_is_served(gateway: RunningGateway) -> None:
    """A vllm-http front behind asks its servers for ``stream_interval`` (vLLM's): a stream-gateway
    upstream takes it and streams its own chunks, every token there."""
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 9, "stream": True, "stream_interval": 4,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    with httpx.stream("POST", f"{gateway.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        frames = [orjson.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert sum(len(f["choices"][0]["token_ids"] or ()) for f in frames if f["choices"]) == 9


# -- routed experts (R3) on tiny-moe: vLLM's per-choice ``routed_experts`` (npy + base64)


@pytest.fixture(scope="module")
def moe_path() -> Path:
    return Path(resolve_model("tiny-moe"))


@pytest.fixture(scope="module")
def moe_gateway(moe_path: Path) -> Iterator[RunningGateway]:
    settings = Settings(model=str(moe_path), served_model_name="tiny-moe", max_batch_size=8)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


@pytest.fixture(scope="module")
def moe_reference(moe_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


def _npy(value: str) -> np.ndarray:
    """vLLM's decoding of ``routed_experts``."""
    routes: np.ndarray = np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)
    return routes


def _agreement(model: Any, ids: list[int], routes: np.ndarray, start: int = 0) -> tuple[int, int]:
    """(agreeing, all) (position, layer) expert sets of ``routes`` (rows from ``start``) and a forward pass."""
    free = free_routes(model, ids)[start:]
    assert routes.shape == free.shape, (routes.shape, free.shape)
    same = (np.sort(routes, axis=-1) == np.sort(free, axis=-1)).all(axis=-1)
    return int(same.sum()), same.size


MOE_PROMPT = [1, 85, 741, 201, 1462, 941, 33]


def test_routed_experts_come_back_per_choice_whole_and_on_each_streamed_choices_last_chunk(
    moe_gateway: RunningGateway, moe_reference: Any
) -> None:
    body = {"model": "tiny-moe", "prompt": MOE_PROMPT, "max_tokens": 10, "n": 2, "temperature": 1.0, "seed": 4,
            "return_token_ids": True, "return_routed_experts": True}  # fmt: skip
    agree = total = 0
    whole = _post(moe_gateway, body).json()
    assert len(whole["choices"]) == 2
    for choice in whole["choices"]:
        assert set(choice) == VLLM_CHOICE
        routes = _npy(choice["routed_experts"])
        ids = MOE_PROMPT + choice["token_ids"]
        assert routes.dtype == np.uint8 and routes.shape == (len(ids) - 1, 3, 2)  # vLLM's [num_tokens - 1, L, K]
        a, t = _agreement(moe_reference, ids, routes)
        agree, total = agree + a, total + t
    # Streamed with n=2: the choices' last updates often wait together and are merged into one
    # frame per choice (completion/_channel.py's coalesce); each keeps its routes.
    chunks = [c["choices"][0] for c in _frames(_post(moe_gateway, {**body, "seed": 4, "stream": True}))]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert all(set(c) == VLLM_STREAM_CHOICE | {"routed_experts"} for c in mine)
        assert all(c["routed_experts"] is None for c in mine[:-1]) and mine[-1]["finish_reason"] is not None
        routes = _npy(mine[-1]["routed_experts"])
        ids = MOE_PROMPT + [t for c in mine for t in c["token_ids"]]
        assert routes.dtype == np.uint8 and routes.shape == (len(ids) - 1, 3, 2)
        a, t = _agreement(moe_reference, ids, routes)
        agree, total = agree + a, total + t
    assert agree / total >= 0.999, f"{total - agree} of {total} (position, layer) routes differ"
    # Not asked for: null on whole choices, absent from chunks (vLLM's stream choice has no such field).
    plain = {**body, "return_routed_experts": False}
    assert all(c["routed_experts"] is None for c in _post(moe_gateway, plain).json()["choices"])
    assert all("routed_experts" not in c["choices"][0] for c in _frames(_post(moe_gateway, {**plain, "stream": True})))


@pytest.mark.parametrize("name", ["routed_experts_start_len", "routed_experts_prompt_start"])
def test_a_start_drops_the_rows_before_it(moe_gateway: RunningGateway, moe_reference: Any, name: str) -> None:
    for start, stream in ((3, False), (len(MOE_PROMPT), True), (0, False)):
        body = {"model": "tiny-moe", "prompt": MOE_PROMPT, "max_tokens": 6, "temperature": 0, "stream": stream,
                "return_token_ids": True, "return_routed_experts": True, name: start}  # fmt: skip
        response = _post(moe_gateway, body)
        if stream:
            mine = [c["choices"][0] for c in _frames(response)]
            output, value = [t for c in mine for t in c["token_ids"]], mine[-1]["routed_experts"]
        else:
            (choice,) = response.json()["choices"]
            output, value = choice["token_ids"], choice["routed_experts"]
        ids = MOE_PROMPT + output
        routes = _npy(value)
        assert routes.shape == (len(ids) - 1 - start, 3, 2)
        agree, total = _agreement(moe_reference, ids, routes, start)
        assert agree / total >= 0.999


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"routed_experts_start_len": len(MOE_PROMPT) + 1}, "routed_experts_start_len"),
        ({"routed_experts_prompt_start": len(MOE_PROMPT) + 1}, "routed_experts_prompt_start"),
        ({"routed_experts_start_len": -1}, "routed_experts_start_len"),
        ({"routed_experts_start_len": 1, "routed_experts_prompt_start": 2}, "routed_experts_prompt_start"),
    ],
)
def test_a_start_outside_the_prompt_is_a_400(moe_gateway: RunningGateway, extra: dict[str, Any], param: str) -> None:
    body = {"model": "tiny-moe", "prompt": MOE_PROMPT, "max_tokens": 2, "return_routed_experts": True, **extra}
    response = _post(moe_gateway, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    batch = {**body, "prompt": [MOE_PROMPT, MOE_PROMPT[:2]], "routed_experts_start_len": 3}
    batch.pop("routed_experts_prompt_start", None)
    shortest = _post(moe_gateway, batch)  # every prompt of a batch must hold the start
    assert shortest.status_code == 400 and shortest.json()["error"]["param"] == "routed_experts_start_len"


def test_a_dense_model_has_no_routed_experts_to_return(gateway: RunningGateway) -> None:
    for stream in (False, True):
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "return_routed_experts": True, "stream": stream}
        response = _post(gateway, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "return_routed_experts" and error["type"] == "invalid_request_error", error


def _counter(gateway: RunningGateway, name: str) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# The kept history's reads of a token-in prompt (completion/_kept.py): its ids parsed, and checked
# against the vocabulary, each for the new ids alone (delta) or all of them (whole).
_FACT_READS = [f'reads_total{{fact="{f}",read="{how}"}}' for f in ("parsed", "checked") for how in ("delta", "whole")]
_FACT_READS += [f'read_items_total{{fact="{f}"}}' for f in ("parsed", "checked")]


def test_a_rollout_continues_through_its_kept_prompt_without_a_pass_over_its_ids(gateway: RunningGateway) -> None:
    """Issue 41, token-in: a rollout's next prompt (the last one, its sampled ids, new ids) is read
    through the kept last body (only the new ids parsed and checked) and placed on the turn that
    body made by comparing the sampled ids alone, counted by the gateway's own counters (the kept
    history's reads: each fact derived through it for the new ids alone); the chain is the one a
    lookup by ids gives. A prompt that changes a sampled id is not that turn's child."""
    session = f"roll{secrets.token_hex(4)}"
    path = f"/sessions/{session}/v1/completions"
    prompt = [(37 * i) % 1900 + 20 for i in range(1500)]  # over the 4 KiB a body needs to be kept
    hits = _counter(gateway, "gateway_history_cache_hits_total")
    kept = _counter(gateway, 'gateway_token_in_matches_total{how="kept"}')
    turns = 4
    sent = 0
    for turn in range(turns):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "return_token_ids": True, "seed": turn}
        reads = {f: _counter(gateway, f"gateway_history_{f}") for f in _FACT_READS}
        answer = _post(gateway, body, path)
        assert answer.status_code == 200, answer.text
        read = {f: _counter(gateway, f"gateway_history_{f}") - reads[f] for f in _FACT_READS}
        delta = 1 if turn else 0  # the first prompt is read whole, every later one for its new ids alone
        expected = {f'reads_total{{fact="{f}",read="{how}"}}': n for f in ("parsed", "checked")
                    for how, n in (("delta", delta), ("whole", 1 - delta))}  # fmt: skip
        expected |= {f'read_items_total{{fact="{f}"}}': len(prompt) - sent for f in ("parsed", "checked")}
        assert read == expected, read
        sent = len(prompt)
        prompt = prompt + answer.json()["choices"][0]["token_ids"] + [5 + turn, 6, 7]
    assert _counter(gateway, "gateway_history_cache_hits_total") - hits == turns - 1
    assert _counter(gateway, 'gateway_token_in_matches_total{how="kept"}') - kept == turns - 1
    recorded = httpx.get(f"{gateway.base_url}/sessions/{session}").json()["turns"]
    assert [t["parent_id"] for t in recorded] == [None, *(t["turn_id"] for t in recorded[:-1])]
    for parent, child in itertools.pairwise(recorded):
        assert child["reused_prompt_tokens"] == len(parent["prompt_ids"]) + len(parent["output_ids"])
        assert child["prompt_ids"][: child["reused_prompt_tokens"]] == parent["prompt_ids"] + parent["output_ids"]
    # The kept last prompt, then a sampled id other than the one sampled: not the last turn's
    # child, but the turn before's (the deepest whose ids it starts with), found by its ids.
    last = recorded[-1]
    by_ids = _counter(gateway, 'gateway_token_in_matches_total{how="ids"}')
    wrong = [*last["prompt_ids"], (last["output_ids"][0] + 1) % 1900 + 20, *last["output_ids"][1:], 9]
    assert _post(gateway, {"model": "tiny", "prompt": wrong, "max_tokens": 2}, path).status_code == 200
    # ... and a new id out of the vocabulary is still refused, with the whole prompt's error;
    bad = _post(gateway, {"model": "tiny", "prompt": [*wrong, 10**9], "max_tokens": 2}, path)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    # so is one in a refused prompt that a next body repeats (kept, but never checked), which
    # would otherwise reach the engine.
    again = _post(gateway, {"model": "tiny", "prompt": [*wrong, 10**9, 5], "max_tokens": 2}, path)
    assert again.status_code == 400 and "1000000000" in again.json()["error"]["message"], again.text
    assert _counter(gateway, 'gateway_token_in_matches_total{how="ids"}') - by_ids == 1  # (the 400 placed nothing)
    after = httpx.get(f"{gateway.base_url}/sessions/{session}").json()["turns"]
    assert len(after) == turns + 1 and after[-1]["parent_id"] == recorded[-2]["turn_id"]
