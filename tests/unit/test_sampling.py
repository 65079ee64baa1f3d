"""Batched sampling with per-row parameters."""

from __future__ import annotations

import torch

from stream_gateway.engines import SamplingParams
from stream_gateway.engines._sampling import sample_batch


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_takes_argmax_with_raw_logprob() -> None:
    logits = torch.randn(3, 50, generator=_gen(0))
    params = [SamplingParams(max_tokens=1, temperature=0.0)] * 3
    out = sample_batch(logits, params, [_gen(1)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.log_softmax(logits, -1).max(-1).values)


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    logits = torch.randn(4, 100, generator=_gen(3))
    params = [SamplingParams(max_tokens=1, temperature=0.9, seed=i) for i in range(4)]
    together = sample_batch(logits, params, [_gen(10 + i) for i in range(4)])
    alone = [sample_batch(logits[i : i + 1], [params[i]], [_gen(10 + i)]).token_ids[0] for i in range(4)]
    assert together.token_ids == alone


def test_top_k_and_top_p_restrict_the_support_and_renormalise() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    for seed in range(50):
        k = sample_batch(logits, [SamplingParams(max_tokens=1, top_k=2)], [_gen(seed)])
        assert k.token_ids[0] in (0, 1)
        expected = torch.log_softmax(logits[0, :2], -1)[k.token_ids[0]]
        assert abs(k.logprobs[0] - float(expected)) < 1e-6
    probs = torch.softmax(logits[0], -1)  # ~[0.64, 0.24, 0.09, ...]
    for seed in range(50):
        p = sample_batch(logits, [SamplingParams(max_tokens=1, top_p=0.8)], [_gen(seed)])
        assert p.token_ids[0] in (0, 1), probs


def test_temperature_scales_the_reported_distribution() -> None:
    logits = torch.randn(1, 30, generator=_gen(5))
    out = sample_batch(logits, [SamplingParams(max_tokens=1, temperature=0.5, top_logprobs=3)], [_gen(6)])
    scaled = torch.log_softmax(logits[0] / 0.5, -1)
    assert abs(out.logprobs[0] - float(scaled[out.token_ids[0]])) < 1e-5
    top = out.top_logprobs[0]
    assert top is not None
    assert [t for t, _ in top] == torch.topk(scaled, 3).indices.tolist()
