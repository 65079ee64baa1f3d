"""The project's fidelity check: a forward pass over a chain's tokens reproduces its logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def assert_chain_logprobs(
    model: Any,
    token_ids: Sequence[int],
    mask: Sequence[int],
    logprobs: Sequence[float],
    *,
    temperature: float = 1.0,
    atol: float = 2e-4,
) -> None:
    """Every position with mask 1 has the logprob an fp32 forward pass of ``model`` gives it."""
    ids = torch.tensor([list(token_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    predicted = torch.log_softmax(logits, -1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
    sampled = torch.tensor(list(mask[1:]), dtype=torch.bool)
    assert mask[0] == 0, "the first token has no prediction: it cannot be a sampled one"
    torch.testing.assert_close(predicted[sampled], torch.tensor(list(logprobs[1:]))[sampled], atol=atol, rtol=0)
