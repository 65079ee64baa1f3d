"""Routed experts from remote servers: what a request asked for, and the routes checked and placed.

Each dialect decodes its own wire form of the routes (vLLM's ``.npy``, SGLang's raw int32); what
happens next is the same for both and lives here (:class:`RouteCheck`): rows must number
``prompt + output - 1`` less the start (or the whole, for a server that ignored the start), ids
must lie below the config's expert count, and the ids become uint8 (at most 256 experts) or
uint16. Anything else is logged and the request keeps no routes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from transformers import AutoConfig

from stream_gateway.engines._base import ExpertShape
from stream_gateway.moe import route_dtype

__all__ = ["RouteCheck", "Wanted", "expert_config"]

log = logging.getLogger(__name__)

_EXPERT_COUNT_NAMES = ("num_experts", "n_routed_experts", "num_local_experts")  # as stream_gateway.moe reads them
_TOP_K_NAMES = ("num_experts_per_tok", "top_k")


@dataclass(frozen=True, slots=True)
class Wanted:
    """What one request asked its server for: routes from ``start``, for a prompt of ``prompt`` ids."""

    prompt: int
    start: int


class RouteCheck:
    """The engine's knowledge of routes: the config's expert shape, the shape servers send, and
    which servers refused or omitted them (each logged once)."""

    def __init__(self, config: ExpertShape | None) -> None:
        self.config = config
        self.experts: ExpertShape | None = config  # until the first routes arrive and tell their shape
        self.routeless: set[str] = set()  # servers that refused return_routed_experts
        self._silent: set[str] = set()  # servers that answered without routes (logged once each)

    def wanted(self, url: str, prompt: int, start: int) -> Wanted | None:
        """What to ask ``url`` for, if anything (a model with experts, a server that takes the flag)."""
        if self.config is None or url in self.routeless:
            return None
        return Wanted(prompt, start)

    def place(self, ids: np.ndarray | None, wanted: Wanted, output: int, url: str) -> tuple[np.ndarray | None, int]:
        """A server's routes checked, narrowed and placed: ``(rows, position of the first)``."""
        config = self.config
        if config is None:
            return None, 0
        if ids is None:
            self.missing(url)
            return None, 0
        if ids.ndim != 3 or (ids.size and (int(ids.min()) < 0 or int(ids.max()) >= config.num_experts)):
            log.warning("%s sent routes of shape %s or outside [0, %d): not kept", url, ids.shape, config.num_experts)
            return None, 0
        whole = wanted.prompt + output - 1
        if len(ids) == whole - wanted.start:
            start = wanted.start
        elif len(ids) == whole:
            start = 0  # the server ignored the start (vLLM before 0.33)
        else:
            log.warning("%s sent %d rows of routes for %d positions from %d: not kept",
                        url, len(ids), whole, wanted.start)  # fmt: skip
            return None, 0
        layers, top_k = ids.shape[1], ids.shape[2]
        if self.experts is None or (self.experts.layers, self.experts.top_k) != (layers, top_k):
            self.experts = ExpertShape(layers, top_k, config.num_experts)
        return ids.astype(route_dtype(config.num_experts), copy=False), start

    def missing(self, url: str) -> None:
        """A server answered without the routes it was asked for (logged once per server)."""
        if url not in self._silent:
            self._silent.add(url)
            log.warning("%s sent no routed experts for a request that asked for them (logged once per server; "
                        "vLLM sends none on streamed completions; SGLang needs --enable-return-routed-experts)",
                        url)  # fmt: skip


def expert_config(path: str) -> ExpertShape | None:
    """``num_hidden_layers``, top-k and expert count from the model's config; ``None``: no experts
    declared (a dense model), or no config to read."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        log.info("no model config at %s (%s)", path, exc)
        return None
    get_text_config = getattr(config, "get_text_config", None)
    config = get_text_config() if callable(get_text_config) else config

    def positive(names: tuple[str, ...]) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    experts, top_k, layers = positive(_EXPERT_COUNT_NAMES), positive(_TOP_K_NAMES), positive(("num_hidden_layers",))
    if experts is None or top_k is None or layers is None:
        return None
    return ExpertShape(layers, top_k, experts)
