"""``tiny``: a Qwen2-architecture model with seeded random weights and a tokenizer trained here.

It speaks Qwen2.5's chat format, tools included, so tests exercise the real template and
tokenizer paths without a hub. Its tokenizer's normalizer is explained in the package docstring.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from stream_gateway.models._corpus import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    _chat_text,
    _code_text,
    _number_text,
    _save_chat_checkpoint,
    _token_id,
    _tool_text,
)

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "TEMPLATE_HEAD",
    "TEMPLATE_SYSTEM_AND_USER_TURNS",
    "TEMPLATE_TOOL_RESULTS",
    "TINY_BUILDER_VERSION",
    "TINY_CHAT_TEMPLATE",
]

TINY_BUILDER_VERSION = 3

# Qwen2.5-Instruct semantics, written afresh. Differences from Qwen2.5: `developer` is a system
# role, content may be a list of text parts, and string `arguments` (as OpenAI clients send
# them) are emitted verbatim instead of being JSON-encoded a second time.
# The pieces tiny-reasoning's template shares (models/_tiny_reasoning.py): the system prompt and
# tool definitions, the other roles' turns, and tool results.
TEMPLATE_HEAD = """\
{%- macro text(content) -%}
{%- if content is none -%}{%- elif content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}\
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role in ['system', 'developer'] -%}
{%- set system = text(messages[0].content) if first_is_system else 'You are a helpful assistant.' -%}
{{- '<|im_start|>system\\n' + system -}}
{%- if tools -%}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
"""
TEMPLATE_SYSTEM_AND_USER_TURNS = """\
{%- for message in messages -%}
{%- if loop.first and first_is_system -%}
{%- elif message.role in ['system', 'developer'] -%}
{{- '<|im_start|>system\\n' + text(message.content) + '<|im_end|>\\n' -}}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\\n' + text(message.content) + '<|im_end|>\\n' -}}
"""
TEMPLATE_TOOL_RESULTS = """\
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
"""
TINY_CHAT_TEMPLATE = (
    TEMPLATE_HEAD
    + TEMPLATE_SYSTEM_AND_USER_TURNS
    + """\
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\\n' + text(message.content) -}}{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}\
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
"""
    + TEMPLATE_TOOL_RESULTS
    + """\
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
)

# Qwen2's pre-tokenizer split: digits one by one, words with their leading space.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_TINY_VOCAB_SIZE = 2000  # including the two added tool-call tokens
_TINY_SEED = 20240601


def _build_tiny(target: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tiny_tokenizer()
    pad = _token_id(tokenizer, ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        # head_dim 32: vLLM's CPU attention kernels take head sizes of 32 and up (16 started, then
        # died on the first request), and every built-in model is served by a real vLLM in the tests.
        # vLLM's Qwen2 derives the head size from hidden / heads, so the width doubled (64 -> 128)
        # rather than the heads halved: with 2 heads of 32, tiny-agent mangled its tool calls on the
        # real agents' long prompts.
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=pad,  # as in Qwen2.5's config; the tokenizer never adds it
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    _seeded_init(model, torch.Generator().manual_seed(_TINY_SEED))
    _save_chat_checkpoint(model, tokenizer, target)


def _seeded_init(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Overwrite every parameter from a private generator, in name order.

    Not ``torch.manual_seed`` + transformers' own init: the global RNG is shared by threads
    (two builds in one process would interleave draws) and the init scheme may change between
    transformers versions; this way the weights depend on the seed and the shapes only.
    """
    import torch

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _train_tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pre

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()  # see the package docstring
    split = pre.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated")
    backend.pre_tokenizer = pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE - 2,
        min_frequency=2,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)])
    return _chat_tokenizer(backend, TINY_CHAT_TEMPLATE)


def _chat_tokenizer(backend: Tokenizer, chat_template: str) -> PreTrainedTokenizerFast:
    """``backend`` as tiny's tokenizer: ChatML's special tokens, ``<|im_end|>`` ending a turn."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # that cleanup drops spaces before punctuation
        model_max_length=131072,
        chat_template=chat_template,
    )


def _synthetic_corpus() -> Iterator[str]:
    """About 400 KB of chat, code, JSON tool calls and numbers; the same text on every call."""
    rng = random.Random(_TINY_SEED)
    makers = (_chat_text, _code_text, _tool_text, _number_text)
    for i in range(1300):
        yield makers[i % len(makers)](rng)
