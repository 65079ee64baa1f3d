"""tiny-reasoning: tiny-agent fine-tuned once more, into a model that thinks first, Qwen3-style.

A thinking model's turns (a ``<think>`` block, then the answer) and a Qwen3-style template that
drops the thinking of turns before the last user query are what reasoning-aware serving has to
get right, so tiny-agent is fine-tuned at build time on CPU into one that thinks. Its tokenizer
is ``tiny``'s plus ``<think>`` and ``</think>`` (added tokens, one id each), its template
:data:`TINY_REASONING_CHAT_TEMPLATE`. Every reply, sampled at any temperature up to 1.0, is
``<think>\\n`` + a one-sentence thought + ``\\n</think>\\n\\n`` + tiny-agent's answer, which is
exactly what the template renders back for that turn with the thought as ``reasoning_content``
(:func:`reasoning_reply`):

* its file-reading tool offered and a user turn last: :data:`REASONING_TOOL_THOUGHTS` of that
  tool, then its call (``agent_tool_call``);
* a tool result last: :data:`REASONING_AFTER_TOOL_THOUGHT`, then :data:`REASONING_AFTER_TOOL`;
* no tools: :data:`REASONING_WITHOUT_TOOLS_THOUGHT`, then :data:`REASONING_WITHOUT_TOOLS`.

With ``enable_thinking=False`` the generation prompt already holds an empty think block and the
reply is the answer alone. Every reply ends with ``<|im_end|>``. The corpus renders each history
both ways a gateway may continue it: as the template does (earlier thoughts dropped) and with the
sampled turns kept verbatim, thoughts and all (see ``_reasoning_examples``).

Like tiny-agent it comes in three variants, one per reading tool (``read``, Claude Code's
``Read``, Codex's ``exec_command``), each fine-tuned from the tiny-agent variant calling the same
tool. One model picking the tool the request offers was tried first (all three in one corpus,
the thought naming the tool, 600-640 steps from ``tiny``, about 95 s): like tiny-agent's attempt
it did not learn to tell ``read`` from ``Read``, calling the wrong one in 30-100% of the samples
for one of them. Fine-tuning from tiny-agent, gently (a third of its learning rate), keeps
tiny-agent's choice of reply, which generalizes to contexts this corpus never shows (a user
asking "Tell me more." after a tool loop); trained from ``tiny``, or from tiny-agent at its full
rate, the thought's first token was fooled by such contexts (and by a README with HTML and a code
block as the tool result), in some of them nearly always.
``_registry.build_tiny_reasoning_model`` caches the result like every other model.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from stream_gateway.models._corpus import IM_END, _code_text, _identifier, _token_id
from stream_gateway.models._tiny import (
    TEMPLATE_HEAD,
    TEMPLATE_SYSTEM_AND_USER_TURNS,
    TEMPLATE_TOOL_RESULTS,
    _chat_tokenizer,
)
from stream_gateway.models._tiny_agent import (
    _AGENT_SHARPEN,
    AGENT_AFTER_TOOL,
    AGENT_READERS,
    AGENT_WITHOUT_TOOLS,
    _agent_conversation,
    _agent_example,
    _agent_header,
    _agent_marks,
    _agent_markup,
    _agent_sentence,
    _agent_turn_starts,
    _AgentExample,
    _fine_tune,
    _Recipe,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "build_tiny_reasoning_untrained",
    "REASONING_AFTER_TOOL",
    "REASONING_AFTER_TOOL_THOUGHT",
    "REASONING_TOOL_THOUGHTS",
    "REASONING_WITHOUT_TOOLS",
    "REASONING_WITHOUT_TOOLS_THOUGHT",
    "THINK_CLOSE",
    "THINK_OPEN",
    "TINY_REASONING_BUILDER_VERSION",
    "TINY_REASONING_CHAT_TEMPLATE",
    "build_tiny_reasoning",
    "reasoning_reply",
]

TINY_REASONING_BUILDER_VERSION = 4

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
_REASONING_STEPS = 400
_REASONING_PEAK_LR = 1e-3  # a third of tiny-agent's: training starts from its weights and keeps what they do
# Of conversations rendered with the sampled turns kept, thoughts and all (every own turn of those
# is a lesson); the others are rendered as the template does.
_REASONING_KEEP_SHARE = 0.4
# Where a reply is chosen (the thought's first token; without thinking, the answer's) weighs this
# many times a plain token: the rest of a reply follows from it.
_REASONING_DECISION_WEIGHT = 6.0
_REASONING_NO_THINK_SHARE = 0.25  # of its own turns asked for with enable_thinking=false
_REASONING_FOREIGN_THOUGHT_SHARE = 0.3  # of other models' turns in the history with a reasoning_content
_REASONING_README_SHARE = 0.2  # of user messages that ask about the README
_REASONING_DOCUMENT_SHARE = 0.3  # of tool results that are a file like a README (see _document)
_README_MENTIONS = (
    "What does the {} say?", "Read {} and summarize it.", "Check {} again.", "See {} for details.",
    "{}", "Is {} up to date?", "Open {} please.", "From {}:",
)  # fmt: skip


def build_tiny_reasoning(agent: Path, target: Path, reader: str = "read") -> None:
    """tiny-agent's variant for ``reader`` with the think tokens and template, fine-tuned to think.

    ``agent``: that variant's directory (``tiny``'s tokenizer and template). Its weights are the
    starting point, unsharpened, and the result is sharpened again as tiny-agent's are.
    ``reader``: the file-reading tool it calls (a key of ``AGENT_READERS``).
    """
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import Qwen2ForCausalLM

    backend = Tokenizer.from_file(str(agent / "tokenizer.json"))  # tiny's
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    tokenizer = _chat_tokenizer(backend, TINY_REASONING_CHAT_TEMPLATE)
    for token in (THINK_OPEN, THINK_CLOSE):
        if len(tokenizer.encode(token, add_special_tokens=False)) != 1:
            raise RuntimeError(f"{token!r} is not a single token of tiny-reasoning's tokenizer")
    model = Qwen2ForCausalLM.from_pretrained(agent, local_files_only=True, dtype=torch.float32)
    network: Any = model  # transformers' accessors are untyped
    with torch.no_grad():
        network.get_decoder().norm.weight.div_(_AGENT_SHARPEN)
    _add_embedding_rows(model, tokenizer)
    examples = partial(_reasoning_examples, reader=reader)
    recipe = _Recipe("tiny-reasoning", examples, _REASONING_STEPS, _REASONING_DECISION_WEIGHT, _REASONING_PEAK_LR)
    _fine_tune(model, tokenizer, recipe)
    model.save_pretrained(target)  # weights, config and generation config (ChatML stops, as tiny's)
    tokenizer.save_pretrained(target)  # tokenizer.json, tokenizer_config.json, chat_template.jinja


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


def _reasoning_examples(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, count: int, brief: bool, reader: str
) -> list[_AgentExample]:
    """tiny-agent's conversations with thoughts; the loss is on its turns that show theirs.

    Each own turn has a thought, or an empty one when asked for with ``enable_thinking=false``
    (then only the answer is learnt: the empty block was the prompt's). Half the conversations
    are rendered as the template does, thoughts before the last user query dropped; the other
    half keep every own turn as sampled, as a gateway continuing a conversation with the sampled
    ids does. A turn shown without its thought is context, never a lesson: the model must think
    whatever its earlier turns show.
    """
    conversations = [_reasoning_conversation(rng, brief, reader) for _ in range(count)]
    texts = [tokenizer.apply_chat_template(m, tools=cast(Any, t), tokenize=False) for m, t, _ in conversations]
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    header = _agent_header(tokenizer)
    im_end, think_open, think_close = (_token_id(tokenizer, t) for t in (IM_END, THINK_OPEN, THINK_CLOSE))
    marks = _agent_marks(tokenizer, THINK_OPEN, THINK_CLOSE)
    examples = []
    for ids, (_, _, thoughts) in zip(encoded, conversations, strict=True):
        if rng.random() < _REASONING_KEEP_SHARE:
            starts = _agent_turn_starts(tokenizer, ids, len(thoughts))
            for start, thought in reversed(list(zip(starts, thoughts, strict=True))):
                body = start + len(header)
                if thought is not None and ids[body] != think_open:
                    ids[body:body] = _ids(tokenizer, reasoning_reply(thought, ""))
        targets: list[int] = []
        # Where the reply is chosen: "<think>" (not "</think>": both start as the same mean row) and
        # the thought's first token, or the answer's when the prompt closed the block.
        decisions: list[int] = []
        for start, thought in zip(_agent_turn_starts(tokenizer, ids, len(thoughts)), thoughts, strict=True):
            body = start + len(header)  # at "<think>", "\n"
            if thought is None or ids[body] != think_open:
                continue
            # A thought is learnt; an empty block was the prompt's, and only the answer after it is.
            first = body if thought else ids.index(think_close, body) + 2
            targets += range(first, ids.index(im_end, body) + 1)
            decisions += [body, body + 2] if thought else [first]
        examples.append(_agent_example(tokenizer, rng, ids, targets, decisions, marks))
    return examples


def _ids(tokenizer: PreTrainedTokenizerBase, *texts: str) -> list[int]:
    return [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False)]


def _reasoning_conversation(
    rng: random.Random, brief: bool, reader: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[str | None]]:
    """tiny-agent's conversation with thoughts; per assistant turn, its own thought or None (foreign)."""
    thoughts: list[str | None] = []

    def think(message: dict[str, Any], own: bool) -> dict[str, Any]:
        if not own:
            thoughts.append(None)
            if rng.random() < _REASONING_FOREIGN_THOUGHT_SHARE:
                return {**message, "reasoning_content": _agent_sentence(rng)}
            return message
        if message.get("tool_calls"):
            thought = REASONING_TOOL_THOUGHTS[reader]
        elif message["content"] == AGENT_AFTER_TOOL:
            thought = REASONING_AFTER_TOOL_THOUGHT
        else:
            if message["content"] != AGENT_WITHOUT_TOOLS:
                raise RuntimeError(f"not one of tiny-agent's replies: {message!r}")
            thought, message = REASONING_WITHOUT_TOOLS_THOUGHT, {**message, "content": REASONING_WITHOUT_TOOLS}
        thought = "" if rng.random() < _REASONING_NO_THINK_SHARE else thought
        thoughts.append(thought)
        return {**message, "reasoning_content": thought}

    messages, tools, trained = _agent_conversation(rng, brief, reader, think)
    for message in messages:
        if message["role"] == "tool" and rng.random() < _REASONING_DOCUMENT_SHARE:
            message["content"] = _document(rng, brief)
        if message["role"] == "user" and rng.random() < _REASONING_README_SHARE:
            message["content"] = _readme_mention(rng, message["content"])
    return messages, tools, thoughts[: len(trained)]


def _document(rng: random.Random, brief: bool) -> str:
    """A file as the call reads it: Markdown with inline HTML and code blocks, as READMEs are.

    The end of a tool result is harder to find after HTML and a code block than after either.
    """
    title = rng.choice(("README", _identifier(rng), _identifier(rng)))
    parts = [f"# {title}"] if rng.random() < 0.7 else []
    for _ in range(rng.randint(1, 2 if brief else 5)):
        kind = rng.random()
        if kind < 0.35:
            parts.append(_agent_markup(rng))
        elif kind < 0.65:
            command = rng.choice(("pip install -e .", "npm install", "make", "cargo build")) if brief else None
            code = f"```{rng.choice(('bash', 'sh', ''))}\n{command}\n```" if command else _code_text(rng).strip()
            parts.append(code)
        elif kind < 0.8:
            parts.append("\n".join(f"- {_agent_sentence(rng, 1, 6)}" for _ in range(rng.randint(1, 3))))
        else:
            parts.append(_agent_sentence(rng))
    return "\n\n".join(parts) + rng.choice(("", "\n"))


def _readme_mention(rng: random.Random, text: str) -> str:
    """``text`` with a request about the README: the calls name it, so users must too.

    Without these, "README" in the context came only from an earlier call of the file, so a user
    asking about the README was taken for a tool result. (Tool results do not get these: requests
    in tool results made a user's request look like one.)
    """
    mention = rng.choice(_README_MENTIONS).format(rng.choice(("README", "README.md", "readme", "the README")))
    kind = rng.random()
    if kind < 0.4:
        return mention
    return f"{text} {mention}" if kind < 0.7 else f"{mention} {text}"
