"""Remote engines: a pool of vLLM (``vllm-http``) or SGLang (``sglang-http``) servers samples.

One engine (:mod:`._engine`) owns lifecycle, the pool, health and failover; one module per wire
dialect (:mod:`._vllm`, :mod:`._sglang`) behind one small seam (:mod:`._dialect`: the request
body, frames -> steps); the LoRA adapter fleet (:mod:`._adapters`), route checks
(:mod:`._routes`), shared wire readers (:mod:`._wire`) and the streaming HTTP client
(:mod:`._stream_http`) beside them. See ``docs/engines.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stream_gateway._errors import UpstreamFailed
from stream_gateway.engines.remote._adapters import adapter_model
from stream_gateway.engines.remote._dialect import Dialect, Exchange
from stream_gateway.engines.remote._engine import DIALECTS, PROTOCOLS, RemoteEngine
from stream_gateway.engines.remote._routes import RouteCheck, Wanted

if TYPE_CHECKING:
    from pathlib import Path

    from stream_gateway._settings import Settings

__all__ = [
    "DIALECTS",
    "Dialect",
    "Exchange",
    "PROTOCOLS",
    "RemoteEngine",
    "RouteCheck",
    "UpstreamFailed",
    "Wanted",
    "adapter_model",
    "create_engine",
    "engine_options",
]


def engine_options(name: str, settings: Settings) -> dict[str, Any]:
    """The pool's constructor arguments from a process's settings (see :mod:`..registry`)."""
    from stream_gateway.engines._build import default_name

    if not settings.upstreams and not (settings.upstreams_bucket and settings.nats_url):
        raise SystemExit(
            f"stream-gateway: --engine {name} needs its servers: --upstream URL (repeatable), "
            "or --upstreams-bucket with --nats-url"
        )
    options: dict[str, Any] = {
        "served_model_name": settings.served_model_name or default_name(settings.model),
        "max_model_len": settings.max_model_len,
        "upstreams": settings.upstreams,
        "api_key": settings.upstream_api_key,
        "health_interval_s": settings.upstream_health_interval_seconds,
        "health_timeout_s": settings.upstream_health_timeout_seconds,
        "connect_timeout_s": settings.upstream_connect_timeout_seconds,
        "read_timeout_s": settings.upstream_read_timeout_seconds,
        "max_connections": settings.upstream_max_connections,
        "routed_experts": settings.routed_experts,
    }
    least = settings.upstream_stream_interval
    most = least if settings.upstream_stream_interval_max is None else settings.upstream_stream_interval_max
    if name == "vllm-http":
        options["protocol"] = "vllm-generate" if settings.vllm_api == "generate" else "vllm"
        options["upstream_weights"] = settings.upstream_weights
        if most < least:
            raise SystemExit(
                f"stream-gateway: --upstream-stream-interval-max ({most}) is below --upstream-stream-interval ({least})"
            )
        options["stream_interval"], options["stream_interval_max"] = least, most
    return options


def create_engine(name: str, model: str | Path, **options: Any) -> RemoteEngine:
    """A :class:`RemoteEngine` speaking ``name``'s dialect unless ``options`` name another."""
    options.setdefault("protocol", PROTOCOLS[name])
    return RemoteEngine(model, **options)
