"""The routed-experts record has one codec and one chaining rule (``pipeline/routes.py``, issue 39)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from consumers.trajectory import ExpertRoutes
from pipeline.events import RoutedExperts
from pipeline.routes import chain_routes_rows, decode_routes, encode_routes, routes_problem
from stream_gateway import moe


def _rows(n: int, dtype: str = "uint8", layers: int = 2, top_k: int = 2) -> np.ndarray:
    return (np.arange(n * layers * top_k) % 200).astype(dtype).reshape(n, layers, top_k)


def test_every_layer_encodes_alike_and_uint16_is_little_endian() -> None:
    rows = _rows(3, "uint16") * 300
    wire = encode_routes(rows)
    assert moe.encode_routes is encode_routes and moe.decode_routes is decode_routes
    assert np.frombuffer(base64.b64decode(wire["data"]), dtype="<u2").tolist() == rows.ravel().tolist()
    record = RoutedExperts(start=0, **wire)
    trajectory = ExpertRoutes(shape=record.shape, dtype=record.dtype, data=record.data)
    assert np.array_equal(trajectory.array(), rows) and np.array_equal(decode_routes(wire), rows)
    assert ExpertRoutes.of(rows) == trajectory
    short = {**wire, "data": wire["data"][:-4]}
    assert routes_problem(tuple(short["shape"]), short["dtype"], short["data"]) is not None
    with pytest.raises(ValueError, match="does not hold 24 bytes"):
        RoutedExperts(start=0, **short)


def test_one_chaining_rule() -> None:
    assert chain_routes_rows([("a", 0, None), ("b", 0, None)], 9) is None
    chained = chain_routes_rows([("a", 0, _rows(4)), ("b", 4, _rows(4, "uint16"))], 9)
    assert chained is not None and chained.shape == (8, 2, 2) and chained.dtype == np.uint16
    for turns, length, reason in [
        ([("a", 0, _rows(4)), ("b", 4, None)], 9, "turn b has no routed_experts"),
        ([("a", 0, _rows(4)), ("b", 3, _rows(5))], 9, "start at 3, not at 4"),
        ([("a", 0, _rows(4)), ("b", 4, _rows(4, layers=3))], 9, r"\[3, 2\] \(layers, top_k\)"),
        ([("a", 0, _rows(4)), ("b", 4, _rows(4))], 10, "hold 8 rows for a chain of 10 ids"),
    ]:
        with pytest.raises(ValueError, match=reason):
            chain_routes_rows(turns, length)
