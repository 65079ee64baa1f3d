"""Routed experts on the wire: the one codec of a mixture-of-experts record (issue 39).

A turn's routes (``RoutedExperts`` in :mod:`pipeline.events`), a trajectory's
(``consumers.trajectory.ExpertRoutes``) and the session API's (``stream_gateway.moe``) are all
``{"shape": [rows, layers, top_k], "dtype": "uint8" | "uint16", "data": <standard base64>}``: the
C-order bytes of the expert ids, uint16 little-endian. This module encodes, decodes and checks that
form; everything else imports it from here.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported by the codec, not by the events that only check sizes
    import numpy as np

__all__ = ["chain_routes_rows", "decode_routes", "encode_routes", "routes_problem", "wire_dtypes"]


@cache
def wire_dtypes() -> dict[str, np.dtype[Any]]:
    """The wire's dtypes by name: uint8, and uint16 little-endian."""
    import numpy as np

    return {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2")}


def encode_routes(routes: np.ndarray[Any, np.dtype[Any]]) -> dict[str, Any]:
    """{"shape": [T, L, K], "dtype": "uint8" | "uint16", "data": <standard base64 of the C-order bytes>}

    uint16 bytes are little-endian.
    """
    import numpy as np

    if routes.ndim != 3:
        raise ValueError(f"routes must be [positions, layers, top_k], got shape {list(routes.shape)}")
    name = routes.dtype.name
    if name not in wire_dtypes():
        raise ValueError(f"routes must be uint8 or uint16, got {name}")
    data = np.ascontiguousarray(routes, dtype=wire_dtypes()[name]).tobytes()
    return {"shape": [int(n) for n in routes.shape], "dtype": name, "data": base64.b64encode(data).decode("ascii")}


def decode_routes(value: Mapping[str, Any]) -> np.ndarray[Any, np.dtype[Any]]:
    """The inverse of :func:`encode_routes`; a clear ValueError for a wrong dtype, shape/size mismatch or bad base64.

    The array is writable and in native byte order.
    """
    import numpy as np

    name, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if not isinstance(name, str) or name not in wire_dtypes():
        raise ValueError(f"routes dtype must be 'uint8' or 'uint16', got {name!r}")
    if (
        not isinstance(shape, list | tuple)
        or len(shape) != 3
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise ValueError(f"routes shape must be three non-negative ints [positions, layers, top_k], got {shape!r}")
    if not isinstance(data, str):
        raise ValueError(f"routes data must be a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"routes data is not valid base64: {exc}") from exc
    dtype = wire_dtypes()[name]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"routes data holds {len(raw)} bytes; shape {list(shape)} of {name} needs {expected}")
    routes = np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    return routes.astype(dtype.newbyteorder("="), copy=False)


def routes_problem(shape: Sequence[int], dtype: str, data: str, tokens: int | None = None) -> str | None:
    """What is wrong with a record of this shape, dtype and base64 data (for a sequence of
    ``tokens`` ids, when given: one row per id but the last); ``None``: nothing. Sizes only, without
    decoding: the records' validators call it on every event."""
    rows, layers, top_k = shape
    if rows < 0 or layers < 1 or top_k < 1:
        return f"routed_experts.shape must be [rows >= 0, layers >= 1, top_k >= 1], not {list(shape)}"
    size = rows * layers * top_k * (1 if dtype == "uint8" else 2)
    padding = len(data) - len(data.rstrip("="))
    if len(data) % 4 or len(data) * 3 // 4 - padding != size:
        return f"routed_experts.data does not hold {size} bytes (shape {list(shape)}, {dtype})"
    if tokens is not None and rows != max(tokens - 1, 0):
        return f"routed_experts has {rows} rows for {tokens} token ids (one per id but the last)"
    return None


def chain_routes_rows(
    turns: Sequence[tuple[str, int, np.ndarray[Any, np.dtype[Any]] | None]], length: int
) -> np.ndarray[Any, np.dtype[Any]] | None:
    """The routes of a chain of ``length`` ids from its turns' own rows, given in chain order as
    ``(turn id, position of the turn's first row, its rows or None)``; ``None``: no turn has any.

    A :class:`ValueError` says why rows that exist cannot make the chain's: a turn without any,
    rows that do not start where the previous turn's end, another number of layers or experts per
    token, or not one row per id but the last (never a guessed alignment). A chain mixing uint8
    and uint16 turns gets uint16. The session API and the assembler both chain with this.
    """
    if all(rows is None for _, _, rows in turns):
        return None
    import numpy as np

    covered = 0
    parts: list[np.ndarray[Any, np.dtype[Any]]] = []
    for turn_id, start, rows in turns:
        if rows is None:
            raise ValueError(f"turn {turn_id} has no routed_experts while others of its chain do")
        if start != covered:
            raise ValueError(f"turn {turn_id}'s routed_experts start at {start}, not at {covered}")
        if parts and rows.shape[1:] != parts[0].shape[1:]:
            raise ValueError(
                f"turn {turn_id} has routes of {list(rows.shape[1:])} (layers, top_k), not {list(parts[0].shape[1:])}"
            )
        parts.append(rows)
        covered += rows.shape[0]
    if covered != max(length - 1, 0):
        raise ValueError(f"the turns' routed_experts hold {covered} rows for a chain of {length} ids")
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0, dtype=np.result_type(*parts))
