"""``build_engine``: the engine a process's settings ask for, on its resolved local model.

Which engine a name means is :data:`~stream_gateway.engines.registry.ENGINES`'s to say; the
options each takes from the settings are its own module's (``engine_options``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_gateway._errors import EngineUnavailable
from stream_gateway.engines._base import Engine
from stream_gateway.engines.registry import ENGINE_NAMES, ENGINES

if TYPE_CHECKING:
    from types import ModuleType

    from stream_gateway._settings import Settings

__all__ = ["ENGINE_NAMES", "build_engine", "create_engine", "default_name"]


def build_engine(settings: Settings) -> Engine:
    """The engine ``settings`` ask for, built (not started) on the resolved local model."""
    from stream_gateway.models import resolve_model

    if settings.engine != "vllm-http" and (
        settings.vllm_api != "completions"
        or settings.upstream_weights != "announce"
        or settings.upstream_stream_interval != 1
    ):
        raise SystemExit(
            "stream-gateway: --vllm-api, --upstream-weights and --upstream-stream-interval are for --engine vllm-http"
        )
    if settings.engine != "scripted" and (settings.script is not None or settings.script_tokens_per_second):
        raise SystemExit("stream-gateway: --script and --script-tokens-per-second are for --engine scripted")
    model = resolve_model(settings.model, settings.model_cache_dir)
    options = _module(settings.engine).engine_options(settings.engine, settings)
    return create_engine(settings.engine, model, **options)


def default_name(model: str) -> str:
    """Clients address the built-in models by their short names, others by their last path part."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def create_engine(name: str, model: str | Path, **options: Any) -> Engine:
    """Build (not start) the engine called ``name`` for ``model``; enter it to start it."""
    engine: Engine = _module(name).create_engine(name, model, **options)
    return engine


def _module(name: str) -> ModuleType:
    entry = ENGINES.get(name)
    if entry is None:
        raise EngineUnavailable(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return importlib.import_module(entry.module)
