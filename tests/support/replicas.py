"""Two gateway replicas capturing into one nats-server, as the pipeline and console tests run them:
the tiny model on the transformers engine, and the synthetic engine at a slow pace with the same
tokenizer (for turns that are still streaming, or that a client walks away from)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from stream_gateway import Settings
from stream_gateway.engines import build_engine

from .servers import run_gateway

__all__ = ["close_session", "tiny_and_slow"]


@contextmanager
def tiny_and_slow(
    nats_url: str, tmp: Path, model: Path, *, tokens_per_second: float = 25, **common: Any
) -> Iterator[tuple[str, str]]:
    """The two replicas' base URLs (``common``: settings both get, e.g. keys); the slow one sends a
    live delta per token."""
    tiny = Settings(model=str(model), served_model_name="tiny", nats_url=nats_url, outbox_dir=tmp / "outbox-a",
                    replica_id="a", **common)  # fmt: skip
    slow = Settings(model=str(model), served_model_name="tiny", engine="synthetic", nats_url=nats_url,
                    synthetic_tokens_per_second=tokens_per_second, outbox_dir=tmp / "outbox-b", replica_id="b",
                    delta_tokens=1, delta_interval_ms=1, **common)  # fmt: skip
    with run_gateway(build_engine(tiny), tiny) as a, run_gateway(build_engine(slow), slow) as b:
        yield a.base_url, b.base_url


def close_session(base: str, key: str, session: str) -> None:
    """``POST /sessions/{session}/close`` with ``key``."""
    httpx.post(f"{base}/sessions/{session}/close", headers={"authorization": f"Bearer {key}"}).raise_for_status()
