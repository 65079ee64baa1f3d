"""Compact, shared token sequences for the turns a session holds in memory.

An agent's session grows by a few thousand tokens a turn while every turn's prompt carries the
whole conversation so far. Held as tuples of Python ints, 50 turns of a 100k-token session cost
2.5M pointers (20 MB), growing with turns times context. :class:`Packed` holds values in a C
``array`` (4 bytes a token id, 8 a logprob) and a continuation's prompt shares its parent's
storage: a node holds only the ids it adds after a ``base`` sequence, so a session's memory is
proportional to its tokens (``held``), however many turns carry them.

Sequences are immutable by contract: nothing writes into an ``array`` once a node holds it, which
is what lets nodes share them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar, overload

import numpy as np

T = TypeVar("T", int, float)


class Packed(Sequence[T]):
    """An immutable sequence: the ``base`` sequence's values, then its own (``array`` of ``typecode``)."""

    __slots__ = ("_base", "_len", "_own")
    typecode: ClassVar[str]
    _base: Packed[T] | None
    _own: array[Any]
    _len: int

    def __init__(self, values: Iterable[T] = (), base: Packed[T] | None = None) -> None:
        own = values if isinstance(values, array) and values.typecode == self.typecode else array(self.typecode, values)
        self._base = base if base is not None and len(base) else None
        self._own = own
        self._len = len(own) + (len(base) if base is not None else 0)

    def then(self, other: Packed[T]) -> Packed[T]:
        """This sequence followed by ``other``'s values, sharing both storages when ``other`` is a
        single node (a turn's output ids); otherwise ``other``'s values are copied."""
        if other._base is None:
            return type(self)(other._own, self)
        return type(self)(other.to_array(), self)

    def head(self, n: int) -> Packed[T]:
        """The first ``n`` values, sharing storage (copies at most one node's part)."""
        if n >= self._len:
            return self
        node: Packed[T] = self
        while node._base is not None and n <= len(node._base):
            node = node._base
        if n == node._len:
            return node
        start = node._len - len(node._own)
        return type(self)(node._own[: n - start], node._base)

    @property
    def held(self) -> int:
        """Values this node stores itself (its share of the memory; the base's are its own nodes')."""
        return len(self._own)

    def to_array(self) -> array[Any]:
        """All the values, as one new ``array``."""
        if self._base is None:
            return array(self.typecode, self._own)
        parts = []
        node: Packed[T] | None = self
        while node is not None:
            parts.append(node._own)
            node = node._base
        out = array(self.typecode)
        for part in reversed(parts):
            out.extend(part)
        return out

    def tolist(self) -> list[T]:
        """All the values, as a list (for JSON)."""
        return self.to_array().tolist()

    def suffix(self, start: int) -> array[Any]:
        """The values from ``start`` on, as a new ``array``, reading only the nodes that hold them."""
        parts = []
        node: Packed[T] | None = self
        while node is not None:
            offset = node._len - len(node._own)
            parts.append(node._own[max(start - offset, 0) :] if start > offset else node._own)
            if start >= offset:
                break
            node = node._base
        out = array(self.typecode)
        for part in reversed(parts):
            out.extend(part)
        return out

    def tobytes(self) -> bytes:
        """The values' machine bytes (what a digest is taken over)."""
        return self._own.tobytes() if self._base is None else self.to_array().tobytes()

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        return iter(self._own if self._base is None else self.to_array())

    def __reversed__(self) -> Iterator[T]:
        values: Iterator[T] = reversed(self._own if self._base is None else self.to_array())
        return values

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step == 1 and stop >= self._len:
                return self.suffix(start).tolist()
            return self.to_array()[index].tolist()
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("index out of range")
        node: Packed[T] = self
        while node._base is not None and index < len(node._base):
            node = node._base
        return node._own[index - (node._len - len(node._own))]  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Packed):
            return self._len == other._len and (self is other or self.to_array() == other.to_array())
        if isinstance(other, (tuple, list)):
            if len(other) != self._len:
                return False
            try:
                return self.to_array() == array(self.typecode, other)
            except (OverflowError, TypeError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.to_array().tobytes())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"


class TokenIds(Packed[int]):
    """Token ids, 4 bytes each (vocabularies are far below 2^31; the prompt checks them)."""

    __slots__ = ()
    typecode = "i"


def wire_ids(ids: Sequence[int]) -> Sequence[int] | np.ndarray[Any, Any]:
    """``ids`` as JSON is written from them fastest: a :class:`TokenIds` as a numpy view of its
    array (no Python int made per id: a 400k-token prompt costs 0.2 ms, not 16), which
    ``orjson.dumps`` writes with ``OPT_SERIALIZE_NUMPY``; anything else as it is."""
    if isinstance(ids, TokenIds):
        values = ids.to_array()
        return np.frombuffer(values, dtype=f"i{values.itemsize}")
    return ids


class Logprobs(Packed[float]):
    """Logprobs, as exact as the engine gave them (8 bytes each)."""

    __slots__ = ()
    typecode = "d"
