"""The engines ``--engine`` can name: one entry each, and where its code lives.

An engine is one module plus one entry here (the shape of vLLM's lazy name tables): the entry
says which module holds it and what the rest of the gateway needs to know without importing it
(whether several gateway processes can share it, whether it samples on a pool of servers). The
module defines two functions, found by name when the engine is asked for:

* ``engine_options(name, settings) -> dict``: the constructor's keyword arguments from a
  process's :class:`~stream_gateway.Settings` (raising ``SystemExit`` with a message for flags
  that do not fit);
* ``create_engine(name, model, **options) -> Engine``: the engine, built, not started.

Nothing here imports an engine, so the optional ``vllm`` extra is never imported on machines
without it, and the settings can list the names without loading a model library. Every engine
passes one conformance suite (``tests/gateway/test_engine_conformance.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["ENGINES", "ENGINE_NAMES", "EngineEntry"]


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """What the gateway knows of an engine before importing it."""

    module: str  # defines engine_options() and create_engine()
    summary: str  # one line for --help and docs/engines.md
    shareable: bool = False  # several gateway processes may share it (--workers): no model in the process
    pool: bool = False  # samples on a pool of servers (--upstream, /admin/upstreams)


ENGINES = MappingProxyType(
    {
        "transformers": EngineEntry(
            "stream_gateway.engines.transformers", "a Hugging Face model in the process (CPU or GPU)"
        ),
        "scripted": EngineEntry(
            "stream_gateway.engines.scripted",
            "answers what a script says, through the model's tokenizer, template and forward pass",
        ),
        "synthetic": EngineEntry(
            "stream_gateway.engines.synthetic", "no model: a fixed passage, for load tests", shareable=True
        ),
        "vllm": EngineEntry("stream_gateway.engines.vllm", "vLLM's AsyncLLM in the process (the vllm extra)"),
        "vllm-http": EngineEntry(
            "stream_gateway.engines.remote", "a pool of vLLM servers over HTTP", shareable=True, pool=True
        ),
        "sglang-http": EngineEntry(
            "stream_gateway.engines.remote", "a pool of SGLang servers over HTTP", shareable=True, pool=True
        ),
    }
)
"""Every engine by its ``--engine`` name."""

ENGINE_NAMES = tuple(ENGINES)
"""The ``--engine`` flag's values."""
