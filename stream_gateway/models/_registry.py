"""The model specs the gateway knows by name, each mapped to its builder and cache directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stream_gateway.models._cache import _cached_build
from stream_gateway.models._shipped import STARTING_POINTS, _shipped_model
from stream_gateway.models._smollm2 import SMOLLM2_BUILDER_VERSION, _convert_smollm2, _smollm2_gguf
from stream_gateway.models._tiny import TINY_BUILDER_VERSION, _build_tiny
from stream_gateway.models._tiny_moe import TINY_MOE_BUILDER_VERSION, build_tiny_moe
from stream_gateway.models._tiny_reasoning import build_tiny_reasoning_untrained
from stream_gateway.models._tiny_vl import build_tiny_vl_untrained

__all__ = [
    "AGENT_VARIANTS",
    "DEFAULT_MODEL",
    "REASONING_VARIANTS",
    "REFERENCE_WEIGHTS",
    "build_tiny_agent_model",
    "build_tiny_model",
    "build_tiny_moe_model",
    "build_tiny_reasoning_model",
    "build_tiny_reasoning_untrained_model",
    "build_tiny_vl_model",
    "build_tiny_vl_untrained_model",
    "resolve_model",
    "smollm2_path",
]

DEFAULT_MODEL = "smollm2"

# The sha256 of the weights of each built-in model that trains nothing, as every build makes them:
# seeded initialisation or a fixed conversion, the same bytes on every machine this project has met
# (AVX2 and AVX-512 ones). A build that comes out otherwise says so in the log, and
# tests/unit/test_model_digests.py checks them. (The trained models' weights ship as files:
# _shipped.SHIPPED_WEIGHTS.) Changing a builder means bumping its version and recording the new digest.
REFERENCE_WEIGHTS = {
    "tiny-qwen2-v3": "bfcaa27e9e0383cf1a0474384685851e2e999da5ef9a1c33afd69206179f1ae0",
    "tiny-moe-v2": "062dc6e4de38e7760041aff4f16e6b789c65f40233a94b6997ed786d231f168e",
    "smollm2-135m-instruct-v1": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
}
# The untrained starting points of tiny-reasoning and tiny-vl: their tokenizers, templates and
# architectures on seeded weights, built in seconds, for the scripted engine (engines/scripted.py).
UNTRAINED_BUILDER_VERSION = 1
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
    ``"tiny-moe"``, ``"tiny-vl"``, the untrained ``"tiny-reasoning-untrained"`` and
    ``"tiny-vl-untrained"``, and ``"smollm2"`` name the local models (built or assembled on first
    use, in seconds; smollm2's conversion in about 30 s), an existing directory becomes its absolute
    path, and anything else (a hub id) is returned unchanged.
    """
    if spec == "tiny":
        return str(build_tiny_model(cache_dir))
    if spec in AGENT_VARIANTS:
        return str(build_tiny_agent_model(cache_dir, spec))
    if spec in REASONING_VARIANTS:
        return str(build_tiny_reasoning_model(cache_dir, spec))
    if spec == "tiny-moe":
        return str(build_tiny_moe_model(cache_dir))
    if spec == "tiny-reasoning-untrained":
        return str(build_tiny_reasoning_untrained_model(cache_dir))
    if spec == "tiny-vl-untrained":
        return str(build_tiny_vl_untrained_model(cache_dir))
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
    name = f"tiny-qwen2-v{TINY_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, TINY_BUILDER_VERSION, _build_tiny, REFERENCE_WEIGHTS.get(name))


def build_tiny_agent_model(cache_dir: Path | None = None, variant: str = "tiny-agent") -> Path:
    """The directory of ``tiny`` fine-tuned to run agent tool loops: ``tiny``'s with the weights the
    package ships (:data:`SHIPPED_WEIGHTS`), assembled on first use in a second.

    Same tokenizer and template as ``tiny``. Its whole repertoire, sampled at any temperature up
    to 1.0: with a ``read`` tool and a user turn last it calls ``read`` on ``README.md``
    (``AGENT_TOOL_CALL``); after a tool result it says ``AGENT_AFTER_TOOL``; without tools it says
    ``AGENT_WITHOUT_TOOLS``. Every reply ends with ``<|im_end|>``. ``variant`` (a key of
    :data:`AGENT_VARIANTS`) picks the tool it calls.
    """
    if variant not in AGENT_VARIANTS:
        raise ValueError(f"not a tiny-agent variant: {variant!r} (one of {sorted(AGENT_VARIANTS)})")
    return _trained(variant, cache_dir)


def build_tiny_reasoning_model(cache_dir: Path | None = None, variant: str = "tiny-reasoning") -> Path:
    """The directory of a tiny-agent variant fine-tuned to think before it answers:
    ``tiny-reasoning-untrained``'s with the weights the package ships, assembled on first use.

    ``tiny``'s tokenizer plus ``<think>`` and ``</think>``, and a Qwen3-style template. Every reply,
    sampled at any temperature up to 1.0, is a ``<think>`` block holding a one-sentence thought,
    then what tiny-agent would say: the call of its reading tool after a user turn
    (``REASONING_TOOL_THOUGHTS``), ``REASONING_AFTER_TOOL`` after a tool result,
    ``REASONING_WITHOUT_TOOLS`` without tools. ``variant`` (a key of :data:`REASONING_VARIANTS`)
    picks the tool it calls.
    """
    if variant not in REASONING_VARIANTS:
        raise ValueError(f"not a tiny-reasoning variant: {variant!r} (one of {sorted(REASONING_VARIANTS)})")
    return _trained(variant, cache_dir)


def _trained(name: str, cache_dir: Path | None) -> Path:
    """The trained model ``name``: its starting point (:data:`STARTING_POINTS`) with its shipped weights."""
    return _shipped_model(name, Path(resolve_model(STARTING_POINTS[name], cache_dir)), cache_dir)


def build_tiny_moe_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny mixture-of-experts test model, built on first use (under a second).

    A Qwen3-MoE model (3 layers, each a sparse block of 8 experts, top-2 routing) with seeded random
    weights and ``tiny``'s tokenizer and template (``tiny`` is built first if need be). Its routers
    are drawn wide, so the top-2 choice stands clear of float noise (see ``_tiny_moe``).
    """
    tiny = build_tiny_model(cache_dir)
    name = f"tiny-moe-v{TINY_MOE_BUILDER_VERSION}"
    build = lambda target: build_tiny_moe(tiny, target)  # noqa: E731
    return _cached_build(cache_dir, name, TINY_MOE_BUILDER_VERSION, build, REFERENCE_WEIGHTS.get(name))


def build_tiny_vl_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny vision-language test model: ``tiny-vl-untrained``'s with the weights
    the package ships, assembled on first use.

    A Qwen2-VL model whose language model is tiny-agent's and whose small vision tower was trained
    with it to name an image's dominant colour (``vl_answer``); without an image it is tiny-agent.
    Its directory holds the image processor too (see ``_tiny_vl``).
    """
    return _trained("tiny-vl", cache_dir)


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct as float32 safetensors, converted on first use."""
    gguf = _smollm2_gguf()
    name = f"smollm2-135m-instruct-v{SMOLLM2_BUILDER_VERSION}"
    build = lambda target: _convert_smollm2(gguf, target)  # noqa: E731
    return _cached_build(cache_dir, name, SMOLLM2_BUILDER_VERSION, build, REFERENCE_WEIGHTS.get(name))


def build_tiny_reasoning_untrained_model(cache_dir: Path | None = None) -> Path:
    """tiny-reasoning's tokenizer, template and architecture on ``tiny``'s weights, untrained (seconds)."""
    return _untrained(cache_dir, "tiny-reasoning-untrained", build_tiny_reasoning_untrained)


def build_tiny_vl_untrained_model(cache_dir: Path | None = None) -> Path:
    """tiny-vl's tokenizer, template, image processor and architecture around ``tiny``, untrained (seconds)."""
    return _untrained(cache_dir, "tiny-vl-untrained", build_tiny_vl_untrained)


def _untrained(cache_dir: Path | None, spec: str, build: Callable[[Path, Path], None]) -> Path:
    """``spec`` built by ``build(tiny, target)`` from ``tiny``, cached."""
    tiny = build_tiny_model(cache_dir)
    name = f"{spec}-v{UNTRAINED_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, UNTRAINED_BUILDER_VERSION, lambda target: build(tiny, target))
