"""Engines that sample tokens for the gateway, behind one small protocol (see :mod:`._base`).

``create_engine`` imports an engine's module only when it is asked for, so the optional
``vllm`` extra is never imported on machines without it. ``vllm-http`` and ``sglang-http``
(:mod:`.remote`) sample on a pool of servers over HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stream_gateway._errors import EngineUnavailable
from stream_gateway.engines._base import (
    Engine,
    EngineStatistics,
    EngineStep,
    FinishReason,
    SamplingParams,
    Upstream,
    UpstreamControl,
    WeightsRejected,
    WeightUpdateReport,
)

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineStatistics",
    "EngineStep",
    "FinishReason",
    "SamplingParams",
    "Upstream",
    "UpstreamControl",
    "WeightUpdateReport",
    "WeightsRejected",
    "build_engine",
    "create_engine",
    "default_name",
    "normalize_url",
]

from stream_gateway.engines._build import build_engine, default_name  # noqa: E402
from stream_gateway.engines._pool import normalize_url  # noqa: E402

ENGINE_NAMES = ("transformers", "synthetic", "vllm", "vllm-http", "sglang-http")


def create_engine(name: str, model: str | Path, **options: Any) -> Engine:
    """Build (not start) the engine called ``name`` for ``model``; enter it to start it."""
    if name == "transformers":
        from stream_gateway.engines.transformers import TransformersEngine

        return TransformersEngine(model, **options)
    if name == "synthetic":
        from stream_gateway.engines.synthetic import SyntheticEngine

        return SyntheticEngine(model, **options)
    if name == "vllm":
        from stream_gateway.engines.vllm import VLLMEngine

        return VLLMEngine(model, **options)
    if name in ("vllm-http", "sglang-http"):
        from stream_gateway.engines.remote import PROTOCOLS, RemoteEngine

        return RemoteEngine(model, protocol=PROTOCOLS[name], **options)
    raise EngineUnavailable(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
