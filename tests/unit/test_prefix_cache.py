"""The transformers engine's prefix cache (engines/_prefix_cache.py) on small tensors: which kept
prompt lends, how much, to whom, and what it forgets."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from stream_gateway.engines._prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 2, 4
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # keys and values, float32


def _cache(ids: list[int]) -> DynamicCache:
    """A one-row cache whose keys at position i hold ids[i] (so a lent slice is checkable)."""
    cache = DynamicCache()
    column = torch.tensor(ids, dtype=torch.float32).view(1, 1, len(ids), 1).expand(1, HEADS, len(ids), DIM)
    for layer in range(LAYERS):
        cache.update(column.clone(), -column.clone(), layer)
    return cache


def _kept(prefixes: PrefixCache, ids: list[int], adapter: str | None = None) -> None:
    prefixes.keep(np.asarray(ids), _cache(ids), adapter)


def _lend(prefixes: PrefixCache, ids: list[int], adapter: str | None = None) -> tuple[int, DynamicCache | None]:
    return prefixes.lend(np.asarray(ids), adapter)


def test_the_longest_shared_prefix_lends_and_the_last_token_always_runs() -> None:
    prefixes = PrefixCache(1 << 20)
    _kept(prefixes, [1, 2, 3, 4, 5, 6])
    _kept(prefixes, [1, 2, 9, 9])
    lent, cache = _lend(prefixes, [1, 2, 3, 4, 5, 7], None)
    assert lent == 5 and cache is not None
    assert cache.get_seq_length() == 5
    assert cache.layers[1].keys is not None and cache.layers[1].keys[0, 0, :, 0].tolist() == [1, 2, 3, 4, 5]
    assert cache.layers[0].values is not None and cache.layers[0].values[0, 1, :, 0].tolist() == [-1, -2, -3, -4, -5]
    # The same prompt again: all but its last token, whose logits the first sampled token needs.
    assert _lend(prefixes, [1, 2, 3, 4, 5, 6], None)[0] == 5
    assert prefixes.hits == 2 and prefixes.lent_tokens == 10


def test_a_prompt_mostly_new_runs_whole() -> None:
    """More than a third new: a borrowed prefix would cost more than it saves (a masked kernel)."""
    prefixes = PrefixCache(1 << 20)
    _kept(prefixes, list(range(1, 61)))
    assert _lend(prefixes, [*range(1, 41), *[0] * 21]) == (0, None)  # 21 of 61 new
    assert _lend(prefixes, [*range(1, 41), *[0] * 20])[0] == 40  # 20 of 60 new
    assert prefixes.hits == 1


def test_nothing_is_lent_to_another_start_another_adapter_or_a_one_token_prompt() -> None:
    prefixes = PrefixCache(1 << 20)
    _kept(prefixes, [1, 2, 3, 4], adapter="a")
    assert _lend(prefixes, [5, 2, 3, 4, 5], "a") == (0, None)
    assert _lend(prefixes, [1, 2, 3, 4, 5], None) == (0, None)
    assert _lend(prefixes, [1, 2, 3, 4, 5], "b") == (0, None)
    assert _lend(prefixes, [1], "a") == (0, None)
    assert _lend(prefixes, [1, 2, 3, 4, 5], "a")[0] == 4


def test_a_prompt_that_continues_a_kept_one_replaces_it() -> None:
    prefixes = PrefixCache(1 << 20)
    _kept(prefixes, [1, 2, 3])
    _kept(prefixes, [1, 2, 3, 4, 5])  # the next turn: the first holds nothing this one does not
    _kept(prefixes, [1, 2, 8])  # a branch: kept beside it
    assert len(prefixes) == 2 and prefixes.nbytes == 8 * PER_TOKEN


def test_the_byte_bound_drops_the_least_recently_used_first() -> None:
    prefixes = PrefixCache(10 * PER_TOKEN)
    _kept(prefixes, [1, 1, 1, 1])
    _kept(prefixes, [2, 2, 2, 2])
    assert _lend(prefixes, [1, 1, 1, 1, 1], None)[0] == 4  # [1...] is now the more recent
    _kept(prefixes, [3, 3, 3, 3])  # 12 tokens would not fit: [2...] goes
    assert _lend(prefixes, [2, 2, 2, 2, 2], None) == (0, None)
    assert _lend(prefixes, [1, 1, 1, 1, 1], None)[0] == 4 and _lend(prefixes, [3, 3, 3, 3, 3], None)[0] == 4
    assert prefixes.nbytes == 8 * PER_TOKEN <= prefixes.capacity_bytes
    _kept(prefixes, list(range(20)))  # larger than the whole bound: not kept, nothing evicted for it
    assert len(prefixes) == 2
    prefixes.clear()
    assert len(prefixes) == 0 and prefixes.nbytes == 0 and _lend(prefixes, [1, 1, 1, 1, 1], None) == (0, None)


def test_lent_views_survive_the_lenders_cache_growing() -> None:
    """The batch appends to a prefilled cache (new tensors, never in place): what was kept stays."""
    prefixes = PrefixCache(1 << 20)
    cache = _cache([1, 2, 3])
    prefixes.keep(np.asarray([1, 2, 3]), cache, None)
    extra = torch.full((1, HEADS, 1, DIM), 99.0)
    for layer in range(LAYERS):
        cache.update(extra, extra, layer)
    lent, borrowed = _lend(prefixes, [1, 2, 3, 4], None)
    assert lent == 3 and borrowed is not None
    assert borrowed.layers[0].keys is not None and borrowed.layers[0].keys[0, 0, :, 0].tolist() == [1, 2, 3]
