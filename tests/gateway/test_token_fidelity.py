"""The ids and logprobs the gateway reports equal a direct forward pass of the same model.

This is the first link of the token-exactness chain: what a client (and later the event
pipeline) is told was sampled, with which probability, is what the model computes for those
exact tokens. The reference is a plain ``AutoModelForCausalLM`` forward pass in fp32 on the
prompt ids plus the sampled ids, done in the test process without the gateway.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List three colours, then explain why the sky is blue. 😀 東京"},
]


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _forward_logprobs(
    model: AutoModelForCausalLM, prompt: list[int], sampled: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + sampled])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    # Position t predicts token t+1: the logits for the sampled tokens start at the prompt's last token.
    scores = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return scores


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_streamed_ids_and_logprobs_match_a_forward_pass(
    client: OpenAI, reference: AutoModelForCausalLM, temperature: float
) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        stream=True,
        max_tokens=48,
        temperature=temperature,
        logprobs=True,
        top_logprobs=5,
        seed=11,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt_ids: list[int] | None = None
    sampled: list[int] = []
    logprobs: list[float] = []
    tops: list[list[float]] = []
    for chunk in stream:
        extra = chunk.model_extra or {}
        if "prompt_token_ids" in extra:
            prompt_ids = extra["prompt_token_ids"]
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids") or []
            sampled.extend(ids)
            entries = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            assert len(entries) == len(ids), "each chunk carries one logprob per token id"
            logprobs.extend(e.logprob for e in entries)
            tops.extend([t.logprob for t in e.top_logprobs] for e in entries)
    assert prompt_ids is not None
    assert len(sampled) == 48
    scores = _forward_logprobs(reference, prompt_ids, sampled, temperature)
    expected = scores.gather(1, torch.tensor(sampled).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=2e-4, rtol=0)
    expected_top = torch.topk(scores, 5, dim=-1).values
    torch.testing.assert_close(torch.tensor(tops), expected_top, atol=2e-4, rtol=0)


def test_prompt_ids_are_the_chat_template_rendering(client: OpenAI, tiny_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"return_token_ids": True}
    )
    extra = reply.model_extra or {}
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert extra["prompt_token_ids"] == list(expected)
    token_ids = (reply.choices[0].model_extra or {})["token_ids"]
    assert reply.usage is not None and reply.usage.completion_tokens == len(token_ids)
    assert tokenizer.decode(token_ids, skip_special_tokens=True).startswith(reply.choices[0].message.content or "")


def test_greedy_logprobs_are_the_raw_distribution(client: OpenAI, reference: AutoModelForCausalLM) -> None:
    """temperature=0 picks the argmax and reports its log-probability under the raw model."""
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    extra = reply.model_extra or {}
    sampled = (reply.choices[0].model_extra or {})["token_ids"]
    scores = _forward_logprobs(reference, extra["prompt_token_ids"], sampled, 1.0)
    assert sampled == scores.argmax(dim=-1).tolist()
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
    reported = torch.tensor([e.logprob for e in reply.choices[0].logprobs.content])
    torch.testing.assert_close(reported, scores.max(dim=-1).values, atol=2e-4, rtol=0)
