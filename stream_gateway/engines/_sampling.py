"""Batched token sampling with per-request parameters and per-request random generators.

Each row of a batch may have its own temperature, top-k, top-p and seed. Rows are sampled by
inverse-CDF lookup with a uniform number drawn from the row's own ``torch.Generator``, so a
seeded request draws the same random numbers whatever else shares its batch.

The returned log-probabilities are "processed": the log-softmax of the distribution the token was
actually drawn from (temperature-scaled, then top-k/top-p filtered and renormalised), which is
what vLLM reports with ``logprobs_mode="processed_logprobs"``. Greedy rows report the raw model
distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stream_gateway.engines._base import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledBatch:
    """Sampled ids, their logprobs and optional top alternatives, one entry per row."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...] | None]


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    forced: Sequence[int | None] | None = None,
) -> SampledBatch:
    """Sample one token per row of ``logits`` ([batch, vocab], any float dtype).

    ``forced[i]``, when given, is row ``i``'s token instead of a draw (the scripted engine): its
    logprob is read from the same processed distribution a draw would have come from (-9999.0 if
    top-k/top-p filtered it out), and the row's generator is left as it was.
    """
    logits = logits.float()
    batch = logits.shape[0]
    greedy = [p.temperature == 0.0 for p in params]
    processed = logits
    if not all(greedy):
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params]).unsqueeze(1)
        processed = logits / temps
        if any(p.top_k > 0 for p in params):
            processed = _apply_top_k(processed, params)
        if any(p.top_p < 1.0 for p in params):
            processed = _apply_top_p(processed, params)
    logprobs = torch.log_softmax(processed, dim=-1)
    raw_logprobs = logprobs if processed is logits else torch.log_softmax(logits, dim=-1)

    chosen = torch.empty(batch, dtype=torch.long)
    if any(greedy):
        chosen.copy_(torch.argmax(logits, dim=-1))
    sampled_rows = [i for i, g in enumerate(greedy) if not g and (forced is None or forced[i] is None)]
    if sampled_rows:
        rows = torch.tensor(sampled_rows)
        uniforms = torch.stack([torch.rand((), generator=generators[i]) for i in sampled_rows])
        cdf = torch.cumsum(logprobs[rows].exp(), dim=-1)
        # Scale by the row total so float round-off in the cumsum can never index past the end.
        draws = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1)).squeeze(1)
        chosen[rows] = torch.clamp(draws, max=logits.shape[1] - 1)
    if forced is not None:
        for i, token in enumerate(forced):
            if token is not None:
                chosen[i] = token

    # Tokens filtered out by top-k/top-p have -inf; report -9999.0 as vLLM and OpenAI do (JSON has no -inf).
    reported = torch.where(torch.tensor(greedy).unsqueeze(1), raw_logprobs, logprobs).clamp(min=-9999.0)
    chosen_logprobs = reported.gather(1, chosen.unsqueeze(1)).squeeze(1)

    top: list[tuple[tuple[int, float], ...] | None] = [None] * batch
    k_max = max((p.top_logprobs for p in params), default=0)
    if k_max > 0:
        values, indices = torch.topk(reported, k_max, dim=-1)
        values_l, indices_l = values.tolist(), indices.tolist()
        for i, p in enumerate(params):
            if p.top_logprobs:
                top[i] = tuple(zip(indices_l[i][: p.top_logprobs], values_l[i][: p.top_logprobs], strict=True))
    return SampledBatch(chosen.tolist(), chosen_logprobs.tolist(), top)


def _apply_top_k(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    sorted_desc = torch.sort(logits, dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; the top token stays.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
