"""The model specs the gateway knows by name, each mapped to its builder and cache directory."""

from __future__ import annotations

from pathlib import Path

from stream_gateway.models._cache import _cached_build
from stream_gateway.models._smollm2 import SMOLLM2_BUILDER_VERSION, _convert_smollm2, _smollm2_gguf
from stream_gateway.models._tiny import TINY_BUILDER_VERSION, _build_tiny
from stream_gateway.models._tiny_agent import TINY_AGENT_BUILDER_VERSION, build_tiny_agent
from stream_gateway.models._tiny_moe import TINY_MOE_BUILDER_VERSION, build_tiny_moe
from stream_gateway.models._tiny_reasoning import TINY_REASONING_BUILDER_VERSION, build_tiny_reasoning
from stream_gateway.models._tiny_vl import TINY_VL_BUILDER_VERSION, build_tiny_vl

__all__ = [
    "AGENT_VARIANTS",
    "DEFAULT_MODEL",
    "REASONING_VARIANTS",
    "build_tiny_agent_model",
    "build_tiny_model",
    "build_tiny_moe_model",
    "build_tiny_reasoning_model",
    "build_tiny_vl_model",
    "resolve_model",
    "smollm2_path",
]

DEFAULT_MODEL = "smollm2"
# tiny-agent and its variants: the file-reading tool each calls (_tiny_agent.AGENT_READERS).
AGENT_VARIANTS = {"tiny-agent": "read", "tiny-agent-claude": "Read", "tiny-agent-codex": "exec_command"}
# tiny-reasoning and its variants, the same way (one model picking among the three does not learn
# to tell ``read`` from ``Read``: see docs/models.md).
REASONING_VARIANTS = {
    "tiny-reasoning": "read",
    "tiny-reasoning-claude": "Read",
    "tiny-reasoning-codex": "exec_command",
}


def resolve_model(spec: str, cache_dir: Path | None = None) -> str:
    """Turn a model spec into something ``from_pretrained`` accepts.

    ``"tiny"``, ``"tiny-agent"`` (and its variants ``"tiny-agent-claude"``, ``"tiny-agent-codex"``),
    ``"tiny-reasoning"`` (and ``"tiny-reasoning-claude"``, ``"tiny-reasoning-codex"``),
    ``"tiny-moe"``, ``"tiny-vl"`` and ``"smollm2"`` name the local models (built on first use), an existing
    directory becomes its absolute path, and anything else (a hub id) is returned unchanged.
    """
    if spec == "tiny":
        return str(build_tiny_model(cache_dir))
    if spec in AGENT_VARIANTS:
        return str(build_tiny_agent_model(cache_dir, spec))
    if spec in REASONING_VARIANTS:
        return str(build_tiny_reasoning_model(cache_dir, spec))
    if spec == "tiny-moe":
        return str(build_tiny_moe_model(cache_dir))
    if spec == "tiny-vl":
        return str(build_tiny_vl_model(cache_dir))
    if spec == DEFAULT_MODEL:
        return str(smollm2_path(cache_dir))
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve())
    return spec


def build_tiny_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny deterministic Qwen2-style test model, built on first use."""
    return _cached_build(cache_dir, f"tiny-qwen2-v{TINY_BUILDER_VERSION}", TINY_BUILDER_VERSION, _build_tiny)


def build_tiny_agent_model(cache_dir: Path | None = None, variant: str = "tiny-agent") -> Path:
    """The directory of ``tiny`` fine-tuned to run agent tool loops, built on first use (~40 s).

    Same tokenizer and template as ``tiny``. Its whole repertoire, sampled at any temperature up
    to 1.0: with a ``read`` tool and a user turn last it calls ``read`` on ``README.md``
    (``AGENT_TOOL_CALL``); after a tool result it says ``AGENT_AFTER_TOOL``; without tools it says
    ``AGENT_WITHOUT_TOOLS``. Every reply ends with ``<|im_end|>``. ``variant`` (a key of
    :data:`AGENT_VARIANTS`) picks the tool it calls.
    """
    tiny = build_tiny_model(cache_dir)
    reader = AGENT_VARIANTS[variant]
    name = f"{variant}-v{TINY_AGENT_BUILDER_VERSION}"
    return _cached_build(
        cache_dir, name, TINY_AGENT_BUILDER_VERSION, lambda target: build_tiny_agent(tiny, target, reader)
    )


def build_tiny_reasoning_model(cache_dir: Path | None = None, variant: str = "tiny-reasoning") -> Path:
    """The directory of a tiny-agent variant fine-tuned to think before it answers, built on first use.

    ``tiny``'s tokenizer plus ``<think>`` and ``</think>``, and a Qwen3-style template. Every reply,
    sampled at any temperature up to 1.0, is a ``<think>`` block holding a one-sentence thought,
    then what tiny-agent would say: the call of its reading tool after a user turn
    (``REASONING_TOOL_THOUGHTS``), ``REASONING_AFTER_TOOL`` after a tool result,
    ``REASONING_WITHOUT_TOOLS`` without tools. ``variant`` (a key of :data:`REASONING_VARIANTS`)
    picks the tool it calls; the tiny-agent variant calling the same tool is its starting point
    (built first if need be), and the fine-tuning takes about 50 s more on two idle cores.
    """
    reader = REASONING_VARIANTS[variant]
    agent = build_tiny_agent_model(cache_dir, next(name for name, r in AGENT_VARIANTS.items() if r == reader))
    name = f"{variant}-v{TINY_REASONING_BUILDER_VERSION}"
    return _cached_build(
        cache_dir, name, TINY_REASONING_BUILDER_VERSION, lambda target: build_tiny_reasoning(agent, target, reader)
    )


def build_tiny_moe_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny mixture-of-experts test model, built on first use (under a second).

    A Qwen3-MoE model (3 layers, each a sparse block of 8 experts, top-2 routing) with seeded random
    weights and ``tiny``'s tokenizer and template (``tiny`` is built first if need be). Its routers
    are drawn wide, so the top-2 choice stands clear of float noise (see ``_tiny_moe``).
    """
    tiny = build_tiny_model(cache_dir)
    name = f"tiny-moe-v{TINY_MOE_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, TINY_MOE_BUILDER_VERSION, lambda target: build_tiny_moe(tiny, target))


def build_tiny_vl_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny vision-language test model, built on first use.

    A Qwen2-VL model whose language model is tiny-agent's (built first if need be) and whose small
    vision tower is fine-tuned with it to name an image's dominant colour (``vl_answer``); without
    an image it is tiny-agent. Its directory holds the image processor too (see ``_tiny_vl``).
    """
    agent = build_tiny_agent_model(cache_dir)
    name = f"tiny-vl-v{TINY_VL_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, TINY_VL_BUILDER_VERSION, lambda target: build_tiny_vl(agent, target))


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct as float32 safetensors, converted on first use."""
    gguf = _smollm2_gguf()
    name = f"smollm2-135m-instruct-v{SMOLLM2_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, SMOLLM2_BUILDER_VERSION, lambda target: _convert_smollm2(gguf, target))
