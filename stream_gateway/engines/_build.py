"""``build_engine``: the engine a process's settings ask for, on its resolved local model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_gateway._errors import EngineUnavailable
from stream_gateway._settings import ENGINE_NAMES
from stream_gateway.engines._base import Engine

if TYPE_CHECKING:
    from stream_gateway._settings import Settings

__all__ = ["ENGINE_NAMES", "build_engine", "create_engine", "default_name"]


def build_engine(settings: Settings) -> Engine:
    """The engine ``settings`` ask for, built (not started) on the resolved local model."""
    from stream_gateway.models import resolve_model

    if settings.engine != "vllm-http" and (
        settings.vllm_api != "completions" or settings.upstream_weights != "announce"
    ):
        raise SystemExit("stream-gateway: --vllm-api and --upstream-weights are for --engine vllm-http")
    model = resolve_model(settings.model, settings.model_cache_dir)
    options: dict[str, Any] = {}
    if settings.engine == "transformers":
        options = {
            "served_model_name": settings.served_model_name or default_name(settings.model),
            "max_batch_size": settings.max_batch_size,
            "max_model_len": settings.max_model_len,
            "device": settings.device,
            "recompute_on_update": settings.kv_cache_on_update == "recompute",
            "routed_experts": settings.routed_experts,
            "loras": settings.lora_adapters(),
            "max_loras": settings.max_loras,
        }
    elif settings.engine == "synthetic":
        options = {
            "served_model_name": settings.served_model_name or "synthetic",
            "tokens_per_second": settings.synthetic_tokens_per_second,
        }
        if settings.max_model_len:
            options["max_model_len"] = settings.max_model_len
    elif settings.engine == "vllm":
        options = {
            "served_model_name": settings.served_model_name or default_name(settings.model),
            "max_model_len": settings.max_model_len,
            "dtype": settings.dtype,
        }
    elif settings.engine in ("vllm-http", "sglang-http"):
        if not settings.upstreams and not (settings.upstreams_bucket and settings.nats_url):
            raise SystemExit(
                f"stream-gateway: --engine {settings.engine} needs its servers: --upstream URL (repeatable), "
                "or --upstreams-bucket with --nats-url"
            )
        options = {
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
        if settings.engine == "vllm-http":
            options["protocol"] = "vllm-generate" if settings.vllm_api == "generate" else "vllm"
            options["upstream_weights"] = settings.upstream_weights
    return create_engine(settings.engine, model, **options)


def default_name(model: str) -> str:
    """Clients address the built-in models by their short names, others by their last path part."""
    return model.rstrip("/").rsplit("/", 1)[-1]


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

        options.setdefault("protocol", PROTOCOLS[name])
        return RemoteEngine(model, **options)
    raise EngineUnavailable(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
