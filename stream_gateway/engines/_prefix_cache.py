"""The transformers engine's prefix cache: the keys and values of recent prompts, kept after their
prefill, so that a prompt continuing one prefills only its new tokens.

An agent's next turn is its last prompt, the answer, a tool result and little else: on a 30k-token
Claude Code prompt the tiny model's prefill takes about 8 s on one CPU core (attention is quadratic
in the prompt), and the turn's new tokens a few milliseconds. vLLM and SGLang keep such prefixes in
paged blocks; this engine keeps whole prompts:

* After a prefill, the prompt's ids and each layer's keys and values (``[1, kv_heads, prompt,
  head_dim]``) are kept, under the LoRA adapter that computed them. A kept prompt that the new one
  continues is dropped: the new one holds all it held.
* Before a prefill, the kept prompt sharing the longest prefix with the new one (same adapter)
  lends that prefix: a :class:`~transformers.DynamicCache` of views of its tensors, and the forward
  pass runs over the rest. At least the last prompt token always runs, for the logits of the
  first sampled token. The request's usage reports the lent tokens (``cached_tokens``). Only a
  prompt that is mostly borrowed borrows (:data:`NEW_SHARE_DENOMINATOR`): attention over a
  borrowed prefix takes a slower kernel, which costs more than it saves when most is new.
* A weight update or an adapter change empties it: keys computed by other weights are not this
  policy's (a turn's logprobs stay a forward pass of the weights that sampled it).
* Bounded in bytes (``--prefix-cache-mb``), least recently used first out.

What it changes in the numbers: attention over a lent prefix sums in another order than one pass
over the whole prompt, so a logprob can move in its last float bits (about 1e-6 on the tiny model);
a forward pass over the whole trajectory still reproduces every recorded logprob well within the
fidelity checks' tolerance. Not used with images (a vision-language prompt's positions depend on
the whole prompt) or routed experts (the prompt's routes would be missing for the lent part).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

__all__ = ["NEW_SHARE_DENOMINATOR", "PrefixCache"]

# A prompt borrows only when at most a third of it (1 / this) is new: the forward pass
# over the rest attends through an explicit mask, a slower kernel than a whole prompt's causal one
# (on CPU, a 20k-token prompt of `tiny`: 3.5 s whole, 0.5 s with 19k borrowed, 5 s with 10k, 10.5 s
# with 500). An agent's next turn is mostly its last one; a prompt that is not runs whole.
NEW_SHARE_DENOMINATOR = 3


@dataclass(eq=False, slots=True)
class _Kept:
    """One kept prompt: its ids and each layer's keys and values."""

    ids: np.ndarray
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    adapter: str | None
    nbytes: int


class PrefixCache:
    """Recent prompts' keys and values, ``capacity_bytes`` at most (see the module docstring).

    Used by the engine's worker thread alone: nothing here locks.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # oldest use first
        self._next = 0
        self.nbytes = 0
        self.lent_tokens = 0  # prompt tokens served from here, since start
        self.hits = 0

    def __len__(self) -> int:
        return len(self._kept)

    def lend(self, ids: np.ndarray, adapter: str | None) -> tuple[int, DynamicCache | None]:
        """The longest kept prefix of the prompt ``ids`` (at most all but its last token) as a cache
        of views, and its length; ``(0, None)`` when nothing is kept that starts the same way."""
        if not self._kept or len(ids) < 2:
            return 0, None
        best_key, best = -1, 0
        for key, kept in self._kept.items():
            if kept.adapter != adapter or kept.ids[0] != ids[0]:
                continue
            shared = _shared_prefix(kept.ids, ids)
            if shared > best:
                best_key, best = key, shared
        best = min(best, len(ids) - 1)
        if best == 0 or (len(ids) - best) * NEW_SHARE_DENOMINATOR > len(ids):
            return 0, None
        kept = self._kept[best_key]
        self._kept.move_to_end(best_key)
        cache = DynamicCache()
        for layer, (keys, values) in enumerate(kept.layers):
            cache.update(keys[:, :, :best], values[:, :, :best], layer)
        self.hits += 1
        self.lent_tokens += best
        return best, cache

    def keep(self, ids: np.ndarray, cache: DynamicCache, adapter: str | None) -> None:
        """Keep the prompt ``ids``' keys and values (``cache``: exactly that prompt's, one row)."""
        kept_layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                return  # a layer that keeps no keys and values (linear attention): nothing to lend
            kept_layers.append((keys, values))
        if not kept_layers:
            return
        nbytes = sum(k.nbytes + v.nbytes for k, v in kept_layers)
        if nbytes > self.capacity_bytes:
            return
        # A kept prompt this one continues (or repeats) holds nothing this one does not.
        for key in [
            key
            for key, kept in self._kept.items()
            if kept.adapter == adapter and len(kept.ids) <= len(ids) and _shared_prefix(kept.ids, ids) == len(kept.ids)
        ]:
            self._drop(key)
        while self._kept and self.nbytes + nbytes > self.capacity_bytes:
            self._drop(next(iter(self._kept)))
        self._kept[self._next] = _Kept(ids, tuple(kept_layers), adapter, nbytes)
        self._next += 1
        self.nbytes += nbytes

    def clear(self) -> None:
        """Forget everything (the weights that computed it changed)."""
        self._kept.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._kept.pop(key).nbytes


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
