"""What an independent forward pass says about a mixture of experts' routing, for the route tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["free_routes", "same_experts"]


def free_routes(model: Any, ids: list[int]) -> np.ndarray:
    """The experts an independent forward pass over ``ids`` picks (``output_router_logits``):
    ``[len(ids) - 1, layers, top_k]``, the rows a recorded turn over ``ids`` has."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    return np.stack([logits.topk(top_k, dim=-1).indices.numpy() for logits in out.router_logits], axis=1)[:-1]


def same_experts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per (position, layer): whether both chose the same experts, in any order."""
    return np.asarray((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1))
