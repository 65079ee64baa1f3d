"""Engines that sample tokens for the gateway, behind one small protocol (see :mod:`._base`).

``create_engine`` imports an engine's module only when it is asked for, so the optional
``vllm`` extra is never imported on machines without it. ``vllm-http`` and ``sglang-http``
(:mod:`.remote`) sample on a pool of servers over HTTP.
"""

from stream_gateway._errors import WeightsRejected
from stream_gateway.engines._base import (
    Engine,
    EngineStatistics,
    EngineStep,
    ExpertShape,
    FinishReason,
    PushEngine,
    ReadControl,
    SamplingParams,
    StepSink,
    Upstream,
    UpstreamControl,
    WeightUpdateReport,
)
from stream_gateway.engines._build import ENGINE_NAMES, build_engine, create_engine, default_name
from stream_gateway.engines._pool import normalize_url

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineStatistics",
    "EngineStep",
    "ExpertShape",
    "FinishReason",
    "PushEngine",
    "ReadControl",
    "SamplingParams",
    "StepSink",
    "Upstream",
    "UpstreamControl",
    "WeightUpdateReport",
    "WeightsRejected",
    "build_engine",
    "create_engine",
    "default_name",
    "normalize_url",
]
