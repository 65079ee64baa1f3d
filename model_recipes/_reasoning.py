"""tiny-reasoning's fine-tuning: a tiny-agent variant trained once more, into a model that thinks first.

A thinking model's turns (a ``<think>`` block, then the answer) and a Qwen3-style template that
drops the thinking of turns before the last user query are what reasoning-aware serving has to get
right, so tiny-agent is fine-tuned on CPU into one that thinks. Its tokens, template and
repertoire are ``stream_gateway.models``' (``_tiny_reasoning.py`` there): the recipe starts from the
tiny-agent variant calling the same tool with the think tokens added, as
``build_tiny_reasoning_untrained`` adds them to ``tiny``, and trains on tiny-agent's corpus with a
thought in every reply. The corpus renders each history both ways a gateway may continue it: as the
template does (earlier thoughts dropped) and with the sampled turns kept verbatim, thoughts and all
(see ``_reasoning_examples``).

One model picking the tool the request offers was tried first (all three in one corpus, the thought
naming the tool, 600-640 steps from ``tiny``, about 95 s): like tiny-agent's attempt it did not
learn to tell ``read`` from ``Read``, calling the wrong one in 30-100% of the samples for one of
them. Fine-tuning from tiny-agent, gently (a third of its learning rate), keeps tiny-agent's choice
of reply, which generalizes to contexts this corpus never shows (a user asking "Tell me more."
after a tool loop); trained from ``tiny``, or from tiny-agent at its full rate, the thought's first
token was fooled by such contexts (and by a README with HTML and a code block as the tool result),
in some of them nearly always.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from model_recipes._agent_corpus import _agent_conversation, _agent_markup, _agent_sentence
from model_recipes._agent_training import (
    _AGENT_SHARPEN,
    _agent_example,
    _agent_header,
    _agent_marks,
    _agent_turn_starts,
    _AgentExample,
    _fine_tune,
    _Recipe,
)
from stream_gateway.models import (
    AGENT_AFTER_TOOL,
    AGENT_WITHOUT_TOOLS,
    REASONING_AFTER_TOOL_THOUGHT,
    REASONING_TOOL_THOUGHTS,
    REASONING_WITHOUT_TOOLS,
    REASONING_WITHOUT_TOOLS_THOUGHT,
    reasoning_reply,
)
from stream_gateway.models._corpus import IM_END, _code_text, _identifier, _token_id
from stream_gateway.models._tiny import _chat_tokenizer
from stream_gateway.models._tiny_reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    TINY_REASONING_CHAT_TEMPLATE,
    _add_embedding_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["build_tiny_reasoning"]

_REASONING_STEPS = 400
# Codex's variant learns from two shapes (with and without Codex's context messages), as tiny-agent's
# Codex variant does (_agent_training._AGENT_STEPS_SCALE): at 400 steps it mixed its thought into its
# call ("I should use exec_command", "arguments": ...) in 6 of 200 samples after a finished tool loop.
_REASONING_STEPS_SCALE = {"exec_command": 1.5}  # of _REASONING_STEPS
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
    steps = round(_REASONING_STEPS * _REASONING_STEPS_SCALE.get(reader, 1.0))
    recipe = _Recipe("tiny-reasoning", examples, steps, _REASONING_DECISION_WEIGHT, _REASONING_PEAK_LR)
    _fine_tune(model, tokenizer, recipe)
    model.save_pretrained(target)  # weights, config and generation config (ChatML stops, as tiny's)
    tokenizer.save_pretrained(target)  # tokenizer.json, tokenizer_config.json, chat_template.jinja


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
