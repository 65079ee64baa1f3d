"""tiny-reasoning's tokens, template and repertoire, and its untrained starting point.

tiny-reasoning is tiny-agent fine-tuned once more into a model that thinks first, Qwen3-style; its
weights ship with the package (``_shipped.py``) and its recipe lives outside it
(``model_recipes/``, in the repository). What it is made of lives here, because the untrained
starting point (``tiny-reasoning-untrained``, what the scripted engine serves where a test needs a
model that thinks) and the shipped model share it: its tokenizer is ``tiny``'s plus ``<think>``
and ``</think>`` (added tokens, one id each), its template :data:`TINY_REASONING_CHAT_TEMPLATE`.
Every reply, sampled at any temperature up to 1.0, is ``<think>\\n`` + a one-sentence thought +
``\\n</think>\\n\\n`` + tiny-agent's answer, which is exactly what the template renders back for
that turn with the thought as ``reasoning_content`` (:func:`reasoning_reply`):

* its file-reading tool offered and a user turn last: :data:`REASONING_TOOL_THOUGHTS` of that
  tool, then its call (``agent_tool_call``);
* a tool result last: :data:`REASONING_AFTER_TOOL_THOUGHT`, then :data:`REASONING_AFTER_TOOL`;
* no tools: :data:`REASONING_WITHOUT_TOOLS_THOUGHT`, then :data:`REASONING_WITHOUT_TOOLS`.

With ``enable_thinking=False`` the generation prompt already holds an empty think block and the
reply is the answer alone. Every reply ends with ``<|im_end|>``. It comes in three variants, one
per reading tool (``read``, Claude Code's ``Read``, Codex's ``exec_command``): docs/models.md says
why one model does not choose among them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_gateway.models._corpus import _token_id
from stream_gateway.models._tiny import (
    TEMPLATE_HEAD,
    TEMPLATE_SYSTEM_AND_USER_TURNS,
    TEMPLATE_TOOL_RESULTS,
    _chat_tokenizer,
)
from stream_gateway.models._tiny_agent import AGENT_AFTER_TOOL, AGENT_READERS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "REASONING_AFTER_TOOL",
    "REASONING_AFTER_TOOL_THOUGHT",
    "REASONING_TOOL_THOUGHTS",
    "REASONING_WITHOUT_TOOLS",
    "REASONING_WITHOUT_TOOLS_THOUGHT",
    "THINK_CLOSE",
    "THINK_OPEN",
    "TINY_REASONING_CHAT_TEMPLATE",
    "build_tiny_reasoning_untrained",
    "reasoning_reply",
]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# The thoughts, one per kind of reply; the tool's names the tool it is about to call. No two share
# a pair of words, nor a thought with an answer: a model this small mixes sentences that do.
REASONING_TOOL_THOUGHTS = {reader: f"I should use {reader} for it." for reader in AGENT_READERS}
REASONING_AFTER_TOOL_THOUGHT = "The result is in, now answer."
REASONING_WITHOUT_TOOLS_THOUGHT = "No tools; say hi."
# The answers after the thought (the tool call is tiny-agent's: ``agent_tool_call(reader)``).
REASONING_AFTER_TOOL = AGENT_AFTER_TOOL
REASONING_WITHOUT_TOOLS = "Hello from tiny-reasoning."


def reasoning_reply(thought: str, answer: str) -> str:
    """A reply as tiny-reasoning samples it (less ``<|im_end|>``) and as the template renders it back."""
    return f"{THINK_OPEN}\n{thought}\n{THINK_CLOSE}\n\n{answer}"


# tiny's template (Qwen2.5's semantics) with Qwen3's thinking. An assistant message's reasoning is
# its `reasoning_content`, else what its content holds between <think> and </think> (then dropped
# from the content). Assistant turns after the last user query (a user message that is not a
# tool result) keep their reasoning if they have some or are the last message; the others are
# tiny's turns, reasoning dropped. A kept block sits between "assistant\n" and the content, and a
# tool call right after it takes no newline of its own, so a turn renders as the model samples it.
# `enable_thinking=false` puts an empty block in the generation prompt.
TINY_REASONING_CHAT_TEMPLATE = (
    TEMPLATE_HEAD
    + """\
{%- set ns = namespace(last_query_index=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' and not (text(message.content) | string).startswith('<tool_response>') -%}
{%- set ns.last_query_index = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
"""
    + TEMPLATE_SYSTEM_AND_USER_TURNS
    + """\
{%- elif message.role == 'assistant' -%}
{%- set content = text(message.content) | string -%}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is defined and message.reasoning_content is not none -%}
{%- set reasoning = text(message.reasoning_content) | string -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- set thinking = loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant' -}}
{%- if thinking -%}
{%- set content = content.lstrip('\\n') -%}
{{- '\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content -}}
{%- elif content -%}{{- '\\n' + content -}}
{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{%- if not (loop.first and thinking and not content) -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}\
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
"""
    + TEMPLATE_TOOL_RESULTS
    + """\
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""
)

_REASONING_SEED = 20240603  # the new embedding rows' offsets; the corpus is tiny-agent's RNG's
_REASONING_OPEN_OFFSET = 0.3  # of the rows' spread: <think> starts near "assistant" (_add_embedding_rows)


def build_tiny_reasoning_untrained(tiny: Path, target: Path) -> None:
    """tiny-reasoning before any training: ``tiny``'s weights with the think tags' rows, its tokenizer
    and template. A model that thinks by its template, for the scripted engine (engines/scripted.py)."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Qwen2ForCausalLM

    backend = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    tokenizer = _chat_tokenizer(backend, TINY_REASONING_CHAT_TEMPLATE)
    model = Qwen2ForCausalLM.from_pretrained(tiny, local_files_only=True, dtype=torch.float32)
    _add_embedding_rows(model, tokenizer)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _add_embedding_rows(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Grow the (tied) embeddings to the tokenizer's size and start the think tags' rows.

    ``</think>`` starts as the old rows' mean plus a seeded offset (normal, scaled by their spread).
    ``<think>`` starts as the row of ``assistant`` plus a smaller one: the newline after ``<think>``
    then looks like the one after ``assistant``, where tiny-agent learnt to choose its reply, so the
    thought's first token is chosen by much the same circuit. The tags differ from the start: as two
    copies of the mean row they were one token to the model, and it wrote one for the other.
    """
    import torch

    network: Any = model  # transformers' accessors are untyped
    old = network.get_input_embeddings().weight.shape[0]
    # No mean_resizing: it draws the new rows from the global RNG, and a build must be reproducible.
    network.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    generator = torch.Generator().manual_seed(_REASONING_SEED)
    open_id, close_id = (_token_id(tokenizer, t) for t in (THINK_OPEN, THINK_CLOSE))
    [assistant] = tokenizer.encode("assistant", add_special_tokens=False)
    with torch.no_grad():
        weight = network.get_input_embeddings().weight
        mean, spread = weight[:old].mean(dim=0), weight[:old].std(dim=0)
        weight[close_id] = mean + spread * torch.randn(mean.shape, generator=generator)
        offset = _REASONING_OPEN_OFFSET * spread * torch.randn(mean.shape, generator=generator)
        weight[open_id] = weight[assistant] + offset
