"""The model specs the gateway knows by name, each mapped to its builder and cache directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stream_gateway.models._cache import _cached_build
from stream_gateway.models._smollm2 import SMOLLM2_BUILDER_VERSION, _convert_smollm2, _smollm2_gguf
from stream_gateway.models._tiny import TINY_BUILDER_VERSION, _build_tiny
from stream_gateway.models._tiny_agent import TINY_AGENT_BUILDER_VERSION, build_tiny_agent
from stream_gateway.models._tiny_moe import TINY_MOE_BUILDER_VERSION, build_tiny_moe
from stream_gateway.models._tiny_reasoning import (
    TINY_REASONING_BUILDER_VERSION,
    build_tiny_reasoning,
    build_tiny_reasoning_untrained,
)
from stream_gateway.models._tiny_vl import TINY_VL_BUILDER_VERSION, build_tiny_vl, build_tiny_vl_untrained

__all__ = [
    "AGENT_VARIANTS",
    "DEFAULT_MODEL",
    "REASONING_VARIANTS",
    "REFERENCE_WEIGHTS",
    "SHIPPED_WEIGHTS",
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

# The sha256 of each built-in model's weights as the reference build makes them (torch 2.13.0's
# CPU build on the pinned code paths of _cache.PINNED_NUMERICS: AVX2 kernels, MKL's COMPATIBLE
# branch, two threads; the reference machine is CI's, a 2-core Intel Xeon with AVX-512, whose
# builds these development machines give too, 2026-12-03): every build is deterministic (seeded,
# fixed threads, fp32, no dropout) and pinned, yet the models that train came out otherwise on
# another machine, so a build that differs is logged, and tests/unit/test_model_digests.py checks
# what holds everywhere. Changing a recipe means bumping its
# builder version and recording the new digest here. (tiny, tiny-moe and smollm2 train nothing: their
# digests are the same pinned or not, and kept their versions.)
REFERENCE_WEIGHTS = {
    "tiny-qwen2-v3": "bfcaa27e9e0383cf1a0474384685851e2e999da5ef9a1c33afd69206179f1ae0",
    "tiny-agent-v4": "8cf7d56689ea88385b2ac840e30334ebaee294a63f1fb395d7112d236ddc5c0d",
    "tiny-agent-claude-v4": "d0de1fd3b4229545174a520ee8e9ad7e4e3d606535e2374d4c5d260136875017",
    "tiny-agent-codex-v4": "a40062ddb39b97ef59cb00c245f83cb97c4104d1677f6c88836a3e76dbe322ff",
    "tiny-reasoning-v4": "d821bc6b66af2b8620ddc886b301cbcacf699b97ee725e38c29fecb905d5f793",
    "tiny-reasoning-claude-v4": "6381ec14730deccd14b7ec4ab23c446abae8b3a00a0dcd85f9ad1c03849370c7",
    "tiny-reasoning-codex-v4": "f9b527d9765673c26f83c246ce133ebdbc8443cc0c4c5376639d86e3bbc48291",
    "tiny-moe-v2": "062dc6e4de38e7760041aff4f16e6b789c65f40233a94b6997ed786d231f168e",
    "tiny-vl-v4": "2f1e05bedd7fcce4ae8f8077efd4db1b3834cd8f311a09f352fb3a02bad51416",
    "smollm2-135m-instruct-v1": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
}
# The untrained starting points of tiny-reasoning and tiny-vl: their tokenizers, templates and
# architectures on seeded weights, built in seconds, for the scripted engine (engines/scripted.py).
UNTRAINED_BUILDER_VERSION = 1
UNTRAINED_MODELS = ("tiny-reasoning-untrained", "tiny-vl-untrained")
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
    ``"tiny-vl-untrained"``, and ``"smollm2"`` name the local models (built on first use), an existing
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
    return _cached_build(cache_dir, name, TINY_BUILDER_VERSION, _build_tiny, REFERENCE_WEIGHTS.get(name), "tiny")


# Trained weights that ship with the package (models/weights/NAME.safetensors, ~2 MB each): such a
# model is ``tiny``'s directory with these weights, assembled in a second instead of trained for
# minutes, and the same bytes on every machine. Each is what its recipe built on a development
# machine (tiny-agent and tiny-agent-claude: builder version 4, 2026-12-06); the digests below are
# of those files. The other trained models build from their recipes on first use.
SHIPPED_WEIGHTS = {
    "tiny-agent": "8dd979c791f70174efc7bd3d4e91a9a5caae7a339328aea83278100025cef433",
    "tiny-agent-claude": "a122d38b8a6f66bb165a3b3dd354acb48cfd161df829e02ca56cd5105ec0718f",
}
_SHIPPED_DIR = Path(__file__).resolve().parent / "weights"


def _from_shipped(tiny: Path, variant: str, target: Path) -> None:
    """``tiny``'s tokenizer, template and config with ``variant``'s shipped weights."""
    import shutil

    from stream_gateway.models._cache import MARKER_FILE

    for path in tiny.iterdir():
        if path.is_file() and path.name not in (MARKER_FILE, "model.safetensors"):
            shutil.copy2(path, target / path.name)
    shutil.copyfile(_SHIPPED_DIR / f"{variant}.safetensors", target / "model.safetensors")


def build_tiny_agent_model(cache_dir: Path | None = None, variant: str = "tiny-agent") -> Path:
    """The directory of ``tiny`` fine-tuned to run agent tool loops: from the weights the package
    ships (:data:`SHIPPED_WEIGHTS`, a second), else built by its recipe on first use (minutes).

    Same tokenizer and template as ``tiny``. Its whole repertoire, sampled at any temperature up
    to 1.0: with a ``read`` tool and a user turn last it calls ``read`` on ``README.md``
    (``AGENT_TOOL_CALL``); after a tool result it says ``AGENT_AFTER_TOOL``; without tools it says
    ``AGENT_WITHOUT_TOOLS``. Every reply ends with ``<|im_end|>``. ``variant`` (a key of
    :data:`AGENT_VARIANTS`) picks the tool it calls.
    """
    tiny = build_tiny_model(cache_dir)
    reader = AGENT_VARIANTS[variant]
    if variant in SHIPPED_WEIGHTS and (_SHIPPED_DIR / f"{variant}.safetensors").is_file():
        name = f"{variant}-v{TINY_AGENT_BUILDER_VERSION}-shipped"
        return _cached_build(
            cache_dir,
            name,
            TINY_AGENT_BUILDER_VERSION,
            lambda target: _from_shipped(tiny, variant, target),
            SHIPPED_WEIGHTS[variant],
            None,
        )
    name = f"{variant}-v{TINY_AGENT_BUILDER_VERSION}"
    return _cached_build(
        cache_dir,
        name,
        TINY_AGENT_BUILDER_VERSION,
        lambda target: build_tiny_agent(tiny, target, reader),
        REFERENCE_WEIGHTS.get(name),
        variant,
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
        cache_dir,
        name,
        TINY_REASONING_BUILDER_VERSION,
        lambda target: build_tiny_reasoning(agent, target, reader),
        REFERENCE_WEIGHTS.get(name),
        variant,
    )


def build_tiny_moe_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny mixture-of-experts test model, built on first use (under a second).

    A Qwen3-MoE model (3 layers, each a sparse block of 8 experts, top-2 routing) with seeded random
    weights and ``tiny``'s tokenizer and template (``tiny`` is built first if need be). Its routers
    are drawn wide, so the top-2 choice stands clear of float noise (see ``_tiny_moe``).
    """
    tiny = build_tiny_model(cache_dir)
    name = f"tiny-moe-v{TINY_MOE_BUILDER_VERSION}"
    build = lambda target: build_tiny_moe(tiny, target)  # noqa: E731
    return _cached_build(cache_dir, name, TINY_MOE_BUILDER_VERSION, build, REFERENCE_WEIGHTS.get(name), "tiny-moe")


def build_tiny_vl_model(cache_dir: Path | None = None) -> Path:
    """The directory of the tiny vision-language test model, built on first use.

    A Qwen2-VL model whose language model is tiny-agent's (built first if need be) and whose small
    vision tower is fine-tuned with it to name an image's dominant colour (``vl_answer``); without
    an image it is tiny-agent. Its directory holds the image processor too (see ``_tiny_vl``).
    """
    agent = build_tiny_agent_model(cache_dir)
    name = f"tiny-vl-v{TINY_VL_BUILDER_VERSION}"
    build = lambda target: build_tiny_vl(agent, target)  # noqa: E731
    return _cached_build(cache_dir, name, TINY_VL_BUILDER_VERSION, build, REFERENCE_WEIGHTS.get(name), "tiny-vl")


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct as float32 safetensors, converted on first use."""
    gguf = _smollm2_gguf()
    name = f"smollm2-135m-instruct-v{SMOLLM2_BUILDER_VERSION}"
    build = lambda target: _convert_smollm2(gguf, target)  # noqa: E731
    return _cached_build(cache_dir, name, SMOLLM2_BUILDER_VERSION, build, REFERENCE_WEIGHTS.get(name), DEFAULT_MODEL)


def build_tiny_reasoning_untrained_model(cache_dir: Path | None = None) -> Path:
    """tiny-reasoning's tokenizer, template and architecture on ``tiny``'s weights, untrained (seconds)."""
    return _untrained(cache_dir, "tiny-reasoning-untrained", build_tiny_reasoning_untrained)


def build_tiny_vl_untrained_model(cache_dir: Path | None = None) -> Path:
    """tiny-vl's tokenizer, template, image processor and architecture around ``tiny``, untrained (seconds)."""
    return _untrained(cache_dir, "tiny-vl-untrained", build_tiny_vl_untrained)


def _untrained(cache_dir: Path | None, spec: str, build: Callable[[Path, Path], None]) -> Path:
    """``spec`` built by ``build(tiny, target)`` from ``tiny``, cached (nothing trains: no pinned child)."""
    tiny = build_tiny_model(cache_dir)
    name = f"{spec}-v{UNTRAINED_BUILDER_VERSION}"
    return _cached_build(cache_dir, name, UNTRAINED_BUILDER_VERSION, lambda target: build(tiny, target), None, None)
