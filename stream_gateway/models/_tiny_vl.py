"""tiny-vl: tiny-agent with eyes, a Qwen2-VL model that names the dominant colour of an image.

Image input (OpenAI ``image_url`` parts, Responses ``input_image``, images in tool results) needs a
real vision-language model to run against, and none may be downloaded, so one is built here: a
``Qwen2VLForConditionalGeneration`` whose language model is tiny-agent's (its Qwen2 weights copied
over; with text-only positions Qwen2-VL's mRoPE is the ordinary RoPE, so tiny-agent's behaviour
carries over) and whose vision tower is small and seeded, then both are fine-tuned together on CPU
(``model_recipes/``, in the repository; the weights ship with the package: ``_shipped.py``). This
module builds it before any training, from ``tiny`` (``tiny-vl-untrained``, what the scripted
engine serves where a test needs a model that sees; the shipped tiny-vl is that directory with the
trained weights) or, for the recipe, from tiny-agent. Trained, it answers ``vl_answer`` of an
image's dominant colour (one of ``VL_COLOURS``; ``vl_image`` draws such images:
``_tiny_vl_images.py``) when the last user turn or tool result holds an image, and is tiny-agent
otherwise.

Shapes. Language model: tiny-agent's (hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32,
MLP 256, tied embeddings), ``mrope_section`` [4, 6, 6] (the 16 rotary frequencies of head_dim 32
split over time, height, width). Vision tower: 14-pixel patches, 2 frames a temporal patch (an image
is its frame twice), 2x2 patches merged into one LM token, embed 32, 2 blocks of 2 heads, MLP
ratio 2, output 128 (the language model's width). Tokenizer: tiny-agent's plus the special tokens ``<|vision_start|>``,
``<|vision_end|>``, ``<|image_pad|>`` and ``<|video_pad|>`` (ids 2000-2003).

Image processor: Qwen2-VL's, resizing every image to multiples of 28 pixels with ``min_pixels`` =
4*28*28 and ``max_pixels`` = 16*28*28: between 16 and 64 patches, so 4 to 16 ``<|image_pad|>``
tokens after the 2x2 merge; a square image of 112 pixels or more is 16 tokens, a 200x300 one 12
(grid 8x6 patches).

Deliberate choices:

* The template renders an image part (``image``, ``image_url``, ``input_image``) as one
  ``<|vision_start|><|image_pad|><|vision_end|>``, wherever it is (user, system and tool
  messages): one pad per image, as Qwen2-VL's own template, and whoever feeds the model expands it
  to ``image_grid_thw.prod() // 4`` pads. Otherwise it is tiny's template byte for byte.
* ``preprocessor_config.json`` names ``Qwen2VLImageProcessorPil`` both as the image processor and
  as the processor class. Without torchvision (not a dependency), transformers 5 cannot load a
  ``Qwen2VLProcessor`` at all (its video processor needs torchvision), ``Qwen2VLImageProcessor``
  falls back to the PIL class with a warning, and ``transformers.AutoImageProcessor`` itself is a
  placeholder demanding torchvision. Naming the PIL class makes ``AutoProcessor.from_pretrained``
  return that image processor, with or without torchvision and without a warning (the tokenizer is
  ``AutoTokenizer``'s); vLLM loads ``Qwen2VLProcessor`` by class, which ignores the name.
* Qwen2-VL's configs keep the token ids in ``text_config`` only: ``config.eos_token_id`` does not
  exist, ``config.get_text_config().eos_token_id`` and the generation config hold them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_gateway.models._corpus import ENDOFTEXT, IM_END, _token_id
from stream_gateway.models._tiny import TINY_CHAT_TEMPLATE, _chat_tokenizer
from stream_gateway.models._tiny_vl_images import IMAGE_PAD, IMAGE_PARTS, VIDEO_PAD, VISION_END, VISION_START

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2VLForConditionalGeneration

__all__ = ["TINY_VL_CHAT_TEMPLATE", "build_tiny_vl_untrained"]

# tiny's template, an image part rendered as Qwen2-VL's placeholder.
_TEXT_PART = "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
_TEXT_OR_IMAGE_PART = (
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    f"{{%- elif part.type in {list(IMAGE_PARTS)!r} -%}}{{{{- '{VISION_START}{IMAGE_PAD}{VISION_END}' -}}}}"
    "{%- endif -%}"
)
TINY_VL_CHAT_TEMPLATE = TINY_CHAT_TEMPLATE.replace(_TEXT_PART, _TEXT_OR_IMAGE_PART)

# The image processor's bounds (see the module docstring): 4 to 16 image tokens an image.
_MIN_PIXELS, _MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28
_MROPE_SECTION = [4, 6, 6]
_VL_SEED = 20240605  # the vision tower's weights and the new embedding rows
_VISION = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}


def build_tiny_vl_untrained(tiny: Path, target: Path) -> None:
    """tiny-vl before any training: ``tiny`` as the language model, the vision tower seeded, the same
    tokenizer, template and image processor. A model that sees, for the scripted engine."""
    import torch
    from transformers import Qwen2ForCausalLM
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _vl_tokenizer(tiny)
    text = Qwen2ForCausalLM.from_pretrained(tiny, local_files_only=True, dtype=torch.float32)
    model = _vl_model(text, tokenizer)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=_MIN_PIXELS, max_pixels=_MAX_PIXELS)
    _save(model, tokenizer, image_processor, target)


def _vl_tokenizer(agent: Path) -> PreTrainedTokenizerBase:
    """tiny-agent's tokenizer (tiny's) plus the vision tokens, with tiny-vl's template."""
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_file(str(agent / "tokenizer.json"))
    tokens = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    tokenizer = _chat_tokenizer(backend, TINY_VL_CHAT_TEMPLATE)
    for token in tokens:
        _token_id(tokenizer, token)  # one token each, or this raises
    return tokenizer


def _vl_model(text: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Qwen2VLForConditionalGeneration:
    """A Qwen2-VL model around ``text``'s weights (a Qwen2 model), its vision tower seeded afresh."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    source = text.config
    eos, pad = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": source.hidden_size,
        "intermediate_size": source.intermediate_size,
        "num_hidden_layers": source.num_hidden_layers,
        "num_attention_heads": source.num_attention_heads,
        "num_key_value_heads": source.num_key_value_heads,
        "rms_norm_eps": source.rms_norm_eps,
        "max_position_embeddings": source.max_position_embeddings,
        "rope_parameters": {**source.rope_parameters, "mrope_section": _MROPE_SECTION},
        "bos_token_id": source.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "tie_word_embeddings": True,
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        # the merger's output is the language model's width
        vision_config={
            **_VISION,
            "hidden_size": source.hidden_size,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
        },
        image_token_id=_token_id(tokenizer, IMAGE_PAD),
        video_token_id=_token_id(tokenizer, VIDEO_PAD),
        vision_start_token_id=_token_id(tokenizer, VISION_START),
        vision_end_token_id=_token_id(tokenizer, VISION_END),
        tie_word_embeddings=True,
        dtype="float32",
    )
    model = Qwen2VLForConditionalGeneration(config)  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(_VL_SEED)
    network: Any = model
    _seed_vision(network.model.visual, generator)
    language = network.model.language_model
    state = {name.removeprefix("model."): p for name, p in text.state_dict().items() if name.startswith("model.")}
    old = state["embed_tokens.weight"]
    with torch.no_grad():
        # The vision tokens' rows: the old rows' mean plus a seeded offset scaled by their spread.
        new = old.mean(dim=0) + old.std(dim=0) * torch.randn(
            (len(tokenizer) - old.shape[0], old.shape[1]), generator=generator
        )
        state["embed_tokens.weight"] = torch.cat([old, new])
    language.load_state_dict(state, strict=True)
    model.tie_weights()
    return model


def _seed_vision(visual: Any, generator: torch.Generator) -> None:
    """Draw the vision tower's weights from ``generator``, in name order: norms 1, biases 0, others N(0, 1/fan_in)."""
    import torch

    with torch.no_grad():
        for name, param in sorted(visual.named_parameters()):
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("weight") and ("norm" in name or "ln_q" in name) else 0.0)
            else:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, processor: Any, target: Path) -> None:
    """The checkpoint, ChatML stops as tiny's, and the image processor naming its PIL class."""
    import json

    from transformers import GenerationConfig

    eos, pad = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    tokenizer.eos_token, tokenizer.pad_token = IM_END, ENDOFTEXT
    text_config = model.config.get_text_config()
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=text_config.bos_token_id, eos_token_id=[eos, pad], pad_token_id=pad
    )
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    processor.save_pretrained(target)
    path = target / "preprocessor_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["image_processor_type"] = config["processor_class"] = type(processor).__name__
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
