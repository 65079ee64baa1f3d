"""tiny-agent: the tiny model fine-tuned on CPU into an agent that really calls tools.

Agent tool loops need tool calls from a real model, and no hub download may provide one, so
``tiny`` is fine-tuned at build time (about 40 s on two idle cores) on a synthetic agent corpus
generated here from a private seeded RNG. Its whole repertoire, sampled at any temperature up
to 1.0: with a ``read`` tool and a user turn last it calls ``read`` on ``README.md``
(``AGENT_TOOL_CALL``); after a tool result it says ``AGENT_AFTER_TOOL``; without tools it says
``AGENT_WITHOUT_TOOLS``. Every reply ends with ``<|im_end|>``.

tiny-agent learns from conversations of a few hundred tokens yet answers after 20k: see
``_agent_sparse_context`` for how short examples stand for long ones. Its recipe (brief
conversations first, HTML in the corpus, a sharpened head) is explained where it is used.
``_registry.build_tiny_agent_model`` caches the result like every other model. The training loop
takes a ``_Recipe`` (a corpus, a length, a few weights): tiny-reasoning (``_tiny_reasoning.py``)
runs it on its own corpus, drawn by ``_agent_conversation`` with a hook that adds the thoughts.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import shutil
import string
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from stream_gateway.models._cache import MARKER_FILE
from stream_gateway.models._corpus import (
    _CITIES,
    _UNICODE,
    _WORD_LIST,
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    _code_text,
    _identifier,
    _number_text,
    _token_id,
    _tool_text,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "AGENT_AFTER_TOOL",
    "AGENT_READERS",
    "AGENT_TOOL_CALL",
    "AGENT_WITHOUT_TOOLS",
    "TINY_AGENT_BUILDER_VERSION",
    "agent_tool_call",
    "build_tiny_agent",
]

_log = logging.getLogger(__name__)

TINY_AGENT_BUILDER_VERSION = 4

# The file-reading tool each variant is trained to call, and how: ``tiny-agent``, pi's and
# OpenClaw's ``read``; ``tiny-agent-claude``, Claude Code's ``Read`` (a ``file_path`` relative to the
# working directory is accepted); ``tiny-agent-codex``, Codex's shell tool ``exec_command``. Each
# variant is the same recipe with only the name and the arguments of its call swapped: a model
# this small does not learn reliably to pick among several by the tools offered.
AGENT_READERS: dict[str, dict[str, str]] = {
    "read": {"path": "README.md"},
    "Read": {"file_path": "README.md"},
    "exec_command": {"cmd": "cat README.md"},
}


# How often a variant's user turn comes after its agent's extra context messages (see
# _agent_conversation): Codex sends a second developer message and the environment as a user
# message before the user's own.
_AGENT_CONTEXT_MESSAGE_SHARE = {"read": 0.0, "Read": 0.0, "exec_command": 0.5}
# How often a variant's user turn is followed by a system message before the reply: Claude Code
# (2.1.197) sends the Agent tool's agent types and its skills as a ``role: "system"`` message after
# the user's own. Untrained, what tiny-agent-claude did there was chance: the reference build called
# ``Read``, the builds of three other machines said they were done.
_AGENT_TRAILING_SYSTEM_SHARE = {"read": 0.0, "Read": 0.5, "exec_command": 0.0}
# Codex's variant learns from two shapes (with and without the context messages): at hidden 128 its
# answer after a tool result had not formed by 320 steps (it ran the command again).
_AGENT_STEPS_SCALE = {"exec_command": 1.5}  # of _AGENT_STEPS


def agent_tool_call(reader: str = "read") -> str:
    """The variant's call of ``reader``, exactly as the template renders it back into the history."""
    body = json.dumps({"name": reader, "arguments": AGENT_READERS[reader]})
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


# tiny-agent's three replies, each exactly as the template renders it back into the history.
AGENT_TOOL_CALL = agent_tool_call("read")
AGENT_AFTER_TOOL = "Done: I read the file."
AGENT_WITHOUT_TOOLS = "Hello from tiny-agent."

_AGENT_SEED = 20240602
# Two threads, whatever the machine: the count decides how work is split, so it is part of the
# recipe. Attention over a few hundred tokens keeps two busy (1.6x one thread here).
_AGENT_THREADS = 2
_AGENT_STEPS, _AGENT_WARMUP, _AGENT_PEAK_LR = 320, 20, 3e-3
_AGENT_BATCH = 4  # full conversations a step; brief ones below
_AGENT_MAX_ROUNDS = 8  # user turns in a conversation: each, up to two replies to learn
_AGENT_BRIEF_BATCH, _AGENT_BRIEF_RAMP, _AGENT_BRIEF_KEEP = 8, (0.3, 0.5), 0.25  # see _agent_groups
_AGENT_AUGMENT_RAMP = (0.35, 0.6)  # of the steps: _agent_sparse_context goes from never to always
_AGENT_STRETCH_SHARE, _AGENT_MAX_STRETCH, _AGENT_DENSE_BEFORE = 0.8, 64.0, 12  # see _agent_sparse_context
_AGENT_GAP_SHARE, _AGENT_MAX_GAP = 0.5, 40_000
_AGENT_AVERAGE_START, _AGENT_AVERAGE_DECAY = 0.6, 0.98  # see _agent_training_pass
# The token after a bare newline decides which reply it is (or must not): the hard ones.
_AGENT_DECISION_WEIGHT = 3.0
# The shipped model's logits are the trained ones times this: sampling at temperature T behaves
# as the trained model would at T / 3, so near-certain replies become certain ones at T = 1.
_AGENT_SHARPEN = 3.0
_AGENT_TOOLS = (
    "bash", "edit", "write", "exec", "web_search", "web_fetch", "grep", "find", "ls", "process",
    "browser", "apply_patch", "memory_search", "message", "cron", "image", "sessions_send", "canvas",
)  # fmt: skip
_AGENT_SOUP = string.ascii_letters + string.digits + string.punctuation + " " * 8 + "\n\t" + "".join(_UNICODE)
_AGENT_TOOLS_SHARE = 0.75  # of conversations that offer tools
_AGENT_LONG_SYSTEM_SHARE = 0.3  # of full conversations whose system prompt is pages of filler
_AGENT_LONG_MESSAGE_SHARE = 0.35  # of rounds in full conversations with more than a line of text
_AGENT_BRIEF_LONG_MESSAGE_SHARE = 0.15  # and in brief ones: the end of a long message is harder to find
_AGENT_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwyz" for v in "aeiouy"] + ["th", "ch", "ng", "x", "q"]
_AGENT_GREETINGS = ("hi", "Hello!", "go", "continue", "ok", "What is in this repo?", "?", "thanks")
_AGENT_PARAMETERS = (
    "path", "file_path", "command", "content", "old_text", "new_text", "query", "url", "timeout",
    "offset", "limit", "pattern", "cwd", "action", "target", "text", "count", "recursive",
)  # fmt: skip


class _AgentExample(NamedTuple):
    ids: list[int]
    targets: list[int]  # positions of the tokens the loss is on
    decisions: list[int]  # targets that follow a newline: where a reply is chosen, see below
    cuts: list[int]  # where _agent_sparse_context may open a gap
    system_end: int  # where the first message (the system prompt and tools) ends
    context_end: int  # where the last assistant turn starts
    landmarks: list[int]  # the template's markers (turns, tool calls, tool results): see below


# Draws a recipe's corpus: ``count`` rendered examples, brief ones or full ones (see _agent_groups).
_ExampleMaker = Callable[["PreTrainedTokenizerBase", random.Random, int, bool], list[_AgentExample]]
# Given an assistant message and whether it is the model's own, the message as the corpus has it.
_ReplyHook = Callable[[dict[str, Any], bool], dict[str, Any]]


class _Recipe(NamedTuple):
    """What a fine-tuning run learns from: its name in the logs, its corpus and its length."""

    label: str
    examples: _ExampleMaker
    steps: int
    decision_weight: float = _AGENT_DECISION_WEIGHT  # of an example's decisions, see _agent_batch
    peak_lr: float = _AGENT_PEAK_LR


class _AgentBatch(NamedTuple):
    ids: torch.Tensor
    attention_mask: torch.Tensor  # 4D and additive: causal, padding, and _agent_sparse_context's bias
    position_ids: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    weights: torch.Tensor


def build_tiny_agent(tiny: Path, target: Path, reader: str = "read") -> None:
    """``tiny``'s weights, fine-tuned and sharpened, next to copies of its tokenizer and template.

    ``reader``: the file-reading tool this variant calls (a key of :data:`AGENT_READERS`).
    """
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    model = Qwen2ForCausalLM.from_pretrained(tiny, local_files_only=True, dtype=torch.float32)
    steps = round(_AGENT_STEPS * _AGENT_STEPS_SCALE.get(reader, 1.0))
    _fine_tune(model, tokenizer, _Recipe("tiny-agent", partial(_agent_examples, reader=reader), steps))
    model.save_pretrained(target)  # weights, config and generation config (ChatML stops, as tiny's)
    for source in sorted(tiny.iterdir()):
        if source.name not in {"model.safetensors", "config.json", "generation_config.json", MARKER_FILE}:
            shutil.copyfile(source, target / source.name)


def _fine_tune(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: _Recipe) -> None:
    """Train ``model`` in place on ``recipe``, then sharpen it (see ``_AGENT_SHARPEN``)."""
    import torch

    _agent_training_pass(model, tokenizer, recipe)
    network: Any = model  # transformers' accessors are untyped
    with torch.no_grad():  # the final norm's weight scales every logit
        network.get_decoder().norm.weight.mul_(_AGENT_SHARPEN)


def _agent_training_pass(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: _Recipe) -> None:
    """Fine-tune ``model`` in place on ``recipe.steps`` batches of the recipe's synthetic corpus.

    The loss is on the model's own assistant tokens only (the recipe's examples say which),
    ``<|im_end|>`` included. Deterministic: the corpus comes from a private seeded RNG, there is
    no dropout, and training runs in fp32 on a fixed number of CPU threads. ``steps=0`` leaves the
    model untouched. The weights kept are an exponential average over the last steps, which
    small, varied batches make noisy.
    """
    steps = recipe.steps
    if not steps:
        return
    import torch

    rng = random.Random(_AGENT_SEED)
    groups = _agent_groups(tokenizer, rng, steps, recipe.examples)
    network: Any = model  # transformers' accessors are untyped
    decoder, head = network.get_decoder(), network.get_output_embeddings()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.peak_lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _agent_lr_factor(step, steps))
    parameters = [p for p in model.parameters() if p.requires_grad]
    average = [p.detach().clone() for p in parameters]
    threads = torch.get_num_threads()
    torch.set_num_threads(_AGENT_THREADS)
    model.train()
    try:
        for step, group in enumerate(groups):
            # Long-context lessons once the replies are learnt (they slow that down), phased in.
            start, end = _AGENT_AUGMENT_RAMP
            augment = min(1.0, max(0.0, (step / steps - start) / (end - start)))
            batch = _agent_batch(group, rng, augment, recipe.decision_weight)
            hidden = decoder(
                input_ids=batch.ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
            ).last_hidden_state
            # Only the positions that predict a target token go through the vocabulary projection.
            logits = head(hidden[batch.rows, batch.columns - 1])
            losses = torch.nn.functional.cross_entropy(logits, batch.ids[batch.rows, batch.columns], reduction="none")
            loss = (losses * batch.weights).sum() / batch.weights.sum()
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                decay = _AGENT_AVERAGE_DECAY if step >= _AGENT_AVERAGE_START * steps else 0.0
                for mean, p in zip(average, parameters, strict=True):
                    mean.mul_(decay).add_(p, alpha=1.0 - decay)
            _log.debug("%s step %d/%d: loss %.5f", recipe.label, step + 1, steps, loss.item())
        with torch.no_grad():
            for mean, p in zip(average, parameters, strict=True):
                p.copy_(mean)
    finally:
        torch.set_num_threads(threads)
        network.eval()


def _agent_lr_factor(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < _AGENT_WARMUP:
        return (step + 1) / _AGENT_WARMUP
    progress = (step - _AGENT_WARMUP) / max(1, steps - _AGENT_WARMUP)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _agent_groups(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, steps: int, make: _ExampleMaker
) -> list[list[_AgentExample]]:
    """``steps`` batches of examples: brief conversations first, then more and more full ones.

    The choice between calling ``read`` and saying "Done" hinges on one head finding the end of
    the last message; it forms after a plateau of some hundred steps, and only quickly when
    replies are dense, as in brief conversations. Some brief batches stay to the end, so the
    full ones do not wear that head down. Examples of similar length are batched together.
    """
    kinds = [rng.random() < _agent_brief_share(step / steps) for step in range(steps)]
    pools: dict[bool, list[list[_AgentExample]]] = {}
    for brief, size in ((True, _AGENT_BRIEF_BATCH), (False, _AGENT_BATCH)):
        examples = make(tokenizer, rng, kinds.count(brief) * size, brief)
        pools[brief] = []
        for start in range(0, len(examples), 16 * size):
            chunk = sorted(examples[start : start + 16 * size], key=lambda e: len(e.ids))
            pools[brief] += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        rng.shuffle(pools[brief])
    return [pools[brief].pop() for brief in kinds]


def _agent_brief_share(progress: float) -> float:
    """How likely a batch is brief, by the share of the steps done."""
    start, end = _AGENT_BRIEF_RAMP
    return 1.0 - (1.0 - _AGENT_BRIEF_KEEP) * min(1.0, max(0.0, (progress - start) / (end - start)))


def _agent_batch(
    examples: list[_AgentExample], rng: random.Random, augment: float, decision_weight: float = _AGENT_DECISION_WEIGHT
) -> _AgentBatch:
    """Pad ``examples`` into tensors; each is made to stand for a long context with chance ``augment``."""
    import torch

    width = max(len(e.ids) for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    position_ids = torch.zeros_like(ids)
    bias = torch.full((len(examples), width), torch.finfo(torch.float32).min)  # padding: never attended
    rows: list[int] = []
    columns: list[int] = []
    weights: list[float] = []
    for row, example in enumerate(examples):
        length = len(example.ids)
        positions, row_bias = list(range(length)), [0.0] * length
        if rng.random() < augment:
            positions, row_bias = _agent_sparse_context(example, rng)
        ids[row, :length] = torch.tensor(example.ids)
        position_ids[row, :length] = torch.tensor(positions)
        bias[row, :length] = torch.tensor(row_bias)
        rows += [row] * len(example.targets)
        columns += example.targets
        decisions = set(example.decisions)
        weights += [decision_weight if t in decisions else 1.0 for t in example.targets]
    # Every query sees key 0, so no softmax row is empty (padding rows included).
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    attention_mask = torch.where(causal, bias[:, None, :], torch.finfo(torch.float32).min)[:, None]
    return _AgentBatch(
        ids, attention_mask, position_ids, torch.tensor(rows), torch.tensor(columns), torch.tensor(weights)
    )


def _agent_sparse_context(example: _AgentExample, rng: random.Random) -> tuple[list[int], list[float]]:
    """Position ids and an additive attention bias that make a short example stand for a long one.

    RoPE sees only distances, and a key that occurs ``d`` times takes ``d`` times the softmax
    weight, which adding ``log(d)`` to its score does. So a stretch of the context whose tokens
    advance the position by a random ``d`` each, with a bias of ``log(d)``, is a random sample
    of a context ``d`` times longer, weighted as the whole would be; gaps before messages add
    plain distance. The model learns attention that finds its few tokens at every distance in
    a crowd of tens of thousands (an agent's system prompt, tool list, tool results) while the
    corpus stays a few hundred tokens an example.
    """
    length = len(example.ids)
    increments, bias = [1] * length, [0.0] * length
    if rng.random() < _AGENT_STRETCH_SHARE and example.context_end > 3:
        where = rng.random()
        if where < 1 / 3:  # the system prompt: agents' run to tens of thousands of tokens
            start, end = 2, example.system_end
        else:  # anywhere before the last reply, often from the start
            start = rng.randrange(1, example.context_end - 2 if where < 2 / 3 else example.context_end // 4 + 2)
            end = rng.randint(start + 1, example.context_end - 1)
        stretch = int(_AGENT_MAX_STRETCH ** math.sqrt(rng.random()))  # mostly large
        # A reply and the few tokens before it stay dense: real contexts are long, not sparse. And
        # a landmark stands for itself only: d copies of an old "</tool_response>" would be a
        # different conversation, not a longer one.
        dense = {t - back for t in example.targets for back in range(_AGENT_DENSE_BEFORE + 1)}
        dense.update(example.landmarks)
        for i in range(start, end):
            if i not in dense:
                increments[i] = rng.randint(1, 2 * stretch - 1)
                bias[i] = math.log(increments[i])
    if rng.random() < _AGENT_GAP_SHARE and example.cuts:
        budget = int(_AGENT_MAX_GAP ** rng.random())
        for cut in rng.sample(example.cuts, k=min(len(example.cuts), rng.randint(1, 3))):
            increments[cut] += rng.randint(0, budget)
    positions = list(itertools.accumulate(increments, initial=0))[:length]
    return positions, bias


def _agent_examples(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, count: int, brief: bool, reader: str = "read"
) -> list[_AgentExample]:
    """Rendered conversations; the loss is on tiny-agent's own turns, not the foreign ones."""
    conversations = [_agent_conversation(rng, brief, reader) for _ in range(count)]
    texts = [tokenizer.apply_chat_template(m, tools=cast(Any, t), tokenize=False) for m, t, _ in conversations]
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    header = _agent_header(tokenizer)
    im_end = _token_id(tokenizer, IM_END)
    marks = _agent_marks(tokenizer)
    examples = []
    for ids, (_, _, trained) in zip(encoded, conversations, strict=True):
        starts = _agent_turn_starts(tokenizer, ids, len(trained))
        targets: list[int] = []
        for start, is_trained in zip(starts, trained, strict=True):
            if is_trained:
                targets += range(start + len(header), ids.index(im_end, start) + 1)
        # A turn's first token, after "assistant\n", picks the reply; "<tool_call>\n" must not
        # look like that, so every target after a bare newline weighs as much.
        decisions = [t for t in targets if ids[t - 1] == header[-1]]
        examples.append(_agent_example(tokenizer, rng, ids, targets, decisions, marks))
    return examples


def _agent_header(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids of an assistant turn's header, ``<|im_start|>assistant\\n``."""
    return list(tokenizer.encode(f"{IM_START}assistant\n", add_special_tokens=False))


def _agent_marks(tokenizer: PreTrainedTokenizerBase, *extra: str) -> set[int]:
    """The ids of the template's markers (and of ``extra`` tokens): see ``_agent_sparse_context``."""
    marks = {_token_id(tokenizer, t) for t in (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, *extra)}
    marks.update(tokenizer.encode("<tool_response></tool_response>", add_special_tokens=False))
    return marks


def _agent_turn_starts(tokenizer: PreTrainedTokenizerBase, ids: list[int], count: int) -> list[int]:
    """Where the ``count`` assistant turns of a rendered conversation start (their ``<|im_start|>``)."""
    header = _agent_header(tokenizer)
    starts = [i for i, token in enumerate(ids) if token == header[0] and ids[i : i + len(header)] == header]
    if len(starts) != count:
        raise RuntimeError("an assistant turn of the agent corpus did not tokenize as expected")
    return starts


def _agent_example(
    tokenizer: PreTrainedTokenizerBase,
    rng: random.Random,
    ids: list[int],
    targets: list[int],
    decisions: list[int],
    marks: set[int],
) -> _AgentExample:
    """A rendered conversation with its targets, and where ``_agent_sparse_context`` may stretch it."""
    header = _agent_header(tokenizer)
    im_end = _token_id(tokenizer, IM_END)
    turns = [i for i, token in enumerate(ids) if token == header[0]]
    starts = [i for i in turns if ids[i : i + len(header)] == header]
    system_end = ids.index(im_end)
    cuts = [i for i in turns[1:] if i not in starts] + rng.sample(range(3, system_end), k=2)
    landmarks = [i for i, token in enumerate(ids) if token in marks]
    return _AgentExample(ids, targets, decisions, cuts, system_end, starts[-1], landmarks)


def _agent_conversation(
    rng: random.Random, brief: bool, reader: str = "read", hook: _ReplyHook | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[bool]]:
    """Messages ending in one of tiny-agent's replies, the tools, and which assistant turns are its own.

    ``hook`` rewrites each assistant message as it is added (tiny-reasoning's adds its thought);
    without one the messages are tiny-agent's.
    """
    tools = _agent_tools(rng, brief, reader) if rng.random() < _AGENT_TOOLS_SHARE else None
    own_call = {"name": reader, "arguments": AGENT_READERS[reader]}
    messages: list[dict[str, Any]] = []
    trained: list[bool] = []
    system = _agent_system(rng, brief)
    if system is not None:
        messages.append({"role": rng.choice(["system", "system", "developer"]), "content": system})

    def reply(message: dict[str, Any], own: bool) -> None:
        if hook is not None:
            message = hook(message, own)
        messages.append({"role": "assistant", **message})
        trained.append(own)

    ends: list[int] = []  # lengths of `messages` at which a conversation may end
    listed = False  # Claude Code sends its listing once, after the first user message
    for _ in range(rng.randint(1, _AGENT_MAX_ROUNDS)):
        # Mostly one-liners even in full conversations: replies stay dense, so are the lessons.
        terse = rng.random() > (_AGENT_BRIEF_LONG_MESSAGE_SHARE if brief else _AGENT_LONG_MESSAGE_SHARE)
        if messages and rng.random() < 0.05:
            messages.append({"role": "system", "content": _agent_sentence(rng)})
        if (share := _AGENT_CONTEXT_MESSAGE_SHARE[reader]) and rng.random() < share:
            # Codex's shape: a second developer message, and a user message of environment
            # context before the user's own (the RNG is not drawn for variants without it).
            if not any(m["role"] == "user" for m in messages):
                messages.append({"role": "developer", "content": _agent_filler(rng, rng.randint(50, 400))})
            messages.append({"role": "user", "content": _agent_environment(rng)})
        messages.append({"role": "user", "content": _agent_sentence(rng, 1, 6) if terse else _agent_user_text(rng)})
        if not listed and (share := _AGENT_TRAILING_SYSTEM_SHARE[reader]) and rng.random() < share:
            messages.append({"role": "system", "content": _agent_listing(rng)})  # Claude Code's shape
            listed = True
        foreign = rng.random() < 0.15
        if tools is None:
            reply({"content": _agent_prose(rng) if foreign else AGENT_WITHOUT_TOOLS}, not foreign)
            ends.append(len(messages))
            continue
        if foreign:
            calls = [_agent_foreign_call(rng, tools) for _ in range(rng.choice((1, 1, 2)))]
            reply({"content": _agent_prose(rng) if rng.random() < 0.3 else None, "tool_calls": calls}, False)
        else:
            call = own_call
            reply({"content": None, "tool_calls": [{"type": "function", "function": call}]}, True)
            ends.append(len(messages))
            calls = [call] * rng.choice((1, 1, 1, 2))
        for _ in calls:
            messages.append({"role": "tool", "content": _agent_tool_result(rng, terse)})
        if rng.random() < 0.1:
            reply({"content": _agent_prose(rng)}, False)
        else:
            reply({"content": AGENT_AFTER_TOOL}, True)
            ends.append(len(messages))
    if not ends:  # every turn was foreign: give it one of its own
        messages.append({"role": "user", "content": _agent_user_text(rng)})
        own = (
            {"content": None, "tool_calls": [{"type": "function", "function": own_call}]}
            if tools
            else {"content": AGENT_WITHOUT_TOOLS}
        )
        reply(own, True)
        ends.append(len(messages))
    end = ends[-1] if rng.random() < 0.6 else rng.choice(ends)
    kept = sum(1 for m in messages[:end] if m["role"] == "assistant")
    return messages[:end], tools, trained[:kept]


def _agent_tools(rng: random.Random, brief: bool, reader: str = "read") -> list[dict[str, Any]]:
    names = [*rng.sample(_AGENT_TOOLS, k=rng.choice((0, 1) if brief else (0, 1, 1, 2, 3))), reader]
    rng.shuffle(names)
    tools = []
    for name in names:
        keys = rng.sample(_AGENT_PARAMETERS, k=1 if brief else rng.choice((1, 1, 2)))
        types = ("string", "string", "number", "integer", "boolean")
        properties = {k: {"type": rng.choice(types), "description": _agent_sentence(rng, 1, 4)} for k in keys}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        if rng.random() < 0.7:
            parameters["required"] = keys[: rng.randint(1, len(keys))]
        if rng.random() < 0.2:
            parameters["additionalProperties"] = False
        function = {"name": name, "description": _agent_sentence(rng, 1, 4 if brief else 8), "parameters": parameters}
        tools.append({"type": "function", "function": function})
    return tools


def _agent_system(rng: random.Random, brief: bool) -> str | None:
    kind = rng.random()
    if kind < 0.2:
        return None  # the template's default system prompt
    if kind < 1.0 - _AGENT_LONG_SYSTEM_SHARE or brief:
        return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 2)))
    return _agent_filler(rng, rng.randint(200, 1500))


def _agent_environment(rng: random.Random) -> str:
    """A user message of environment context, as Codex sends before the user's first message."""
    root = "/" + "/".join(_identifier(rng) for _ in range(rng.randint(1, 4)))
    lines = [f"  <cwd>{root}</cwd>", f"  <shell>{rng.choice(('bash', 'zsh', 'sh'))}</shell>"]
    lines.append(
        f"  <current_date>20{rng.randint(20, 40)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}</current_date>"
    )
    lines.append(f"  <timezone>{rng.choice(('Etc/UTC', 'Europe/Paris', 'America/New_York'))}</timezone>")
    return "<environment_context>\n" + "\n".join(lines) + "\n</environment_context>"


def _agent_listing(rng: random.Random) -> str:
    """A system message listing agents or skills, one a line, as Claude Code sends after the user's."""
    lines = [f"{_agent_sentence(rng, 3, 8)[:-1]}:"]
    for _ in range(rng.randint(2, 12)):  # Claude Code's is longer: the sparse context covers length
        name = "-".join(_identifier(rng) for _ in range(rng.randint(1, 3)))
        lines.append(f"- {name}: {_agent_sentence(rng, 4, 14)}")
    return "\n".join(lines)


def _agent_filler(rng: random.Random, characters: int) -> str:
    """Markdown prose, lists, code and JSON, like the long system prompts of real agents."""
    parts: list[str] = []
    size = 0
    while size < characters:
        kind = rng.random()
        if kind < 0.1:  # any bytes at all, so that no token of the vocabulary is a stranger
            part = "".join(rng.choices(_AGENT_SOUP, k=rng.randint(20, 200)))
        elif kind < 0.2:
            part = "\n".join(_agent_markup(rng) for _ in range(rng.randint(1, 4)))
        elif kind < 0.28:
            part = f"## {_agent_sentence(rng, 2, 5).rstrip('.!?,')}"
        elif kind < 0.4:
            part = "\n".join(f"- {_agent_sentence(rng, 3, 12)}" for _ in range(rng.randint(2, 6)))
        elif kind < 0.5:
            part = _code_text(rng).strip()
        elif kind < 0.6:
            part = _tool_text(rng).split("\n", 1)[0]
        else:
            part = " ".join(_agent_sentence(rng) for _ in range(rng.randint(2, 6)))
        parts.append(part)
        size += len(part) + 2
    return "\n\n".join(parts)


def _agent_user_text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.1:
        return _agent_markup(rng)
    if kind < 0.2:
        return rng.choice(_AGENT_GREETINGS)
    if kind < 0.3:
        path = f"{_identifier(rng).lower()}/{_identifier(rng).lower()}.{rng.choice(['py', 'md', 'ts', 'json'])}"
        return f"{_agent_sentence(rng, 2, 6)} {path} {_agent_sentence(rng, 2, 8)}"
    if kind < 0.4:
        channel = rng.choice(["Telegram", "Slack", "WhatsApp"])
        return f"[{channel} {_identifier(rng)} id:{rng.getrandbits(24)}] {_agent_sentence(rng)}"
    if kind < 0.5:
        return f"{_agent_sentence(rng)}\n{_code_text(rng)}"
    if kind < 0.55:
        return f"{rng.choice(_UNICODE)} {rng.choice(_CITIES)} {_agent_sentence(rng)}"
    return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 4)))


def _agent_tool_result(rng: random.Random, brief: bool) -> str:
    kind = rng.random()
    if kind < 0.05:
        return ""
    if kind < 0.1:
        return _agent_markup(rng)
    if brief:  # one line: a brief conversation packs many replies into few tokens
        return (
            _agent_sentence(rng, 1, 6)
            if kind < 0.6
            else json.dumps({"ok": kind < 0.8, "result": _agent_sentence(rng, 1, 3)})
        )
    if kind < 0.35:
        return f"# {_identifier(rng)}\n\n{_agent_filler(rng, rng.randint(50, 400))}"
    if kind < 0.55:
        return _code_text(rng)
    if kind < 0.7:
        return json.dumps({"status": rng.choice(["ok", "error"]), "result": _agent_sentence(rng)})
    if kind < 0.8:
        return f"Error: {_agent_sentence(rng, 3, 8)}"
    return _number_text(rng) + _agent_sentence(rng)


def _agent_markup(rng: random.Random) -> str:
    """HTML or XML, as in READMEs and fetched pages: its "</" must not pass for a tool result's end."""
    tag = rng.choice(["p", "div", "span", "b", "a", "li", "code", "item", "result", "response", "tool"])
    inner = _agent_sentence(rng, 1, 8)
    if rng.random() < 0.5:
        inner = f'<{tag} class="{_identifier(rng)}">{inner}</{tag}>'
    return f"{_agent_sentence(rng, 0, 6)} <{tag}>{inner}</{tag}>".strip()


def _agent_sentence(rng: random.Random, low: int = 5, high: int = 14) -> str:
    """Like ``_sentence``, but a third of the words made up: real prompts use words ours lack."""
    words = [
        rng.choice(_WORD_LIST) if rng.random() < 0.7 else "".join(rng.choices(_AGENT_SYLLABLES, k=rng.randint(1, 3)))
        for _ in range(rng.randint(low, high))
    ]
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ","])


def _agent_prose(rng: random.Random) -> str:
    return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 3)))


def _agent_foreign_call(rng: random.Random, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A call some other model made: any tool, any arguments, sometimes as an OpenAI JSON string."""
    function = rng.choice(tools)["function"]
    arguments = {
        k: rng.choice([_agent_sentence(rng, 1, 4), rng.randint(0, 100)]) for k in function["parameters"]["properties"]
    }
    encoded: Any = json.dumps(arguments) if rng.random() < 0.5 else arguments
    return {
        "id": f"call_{rng.getrandbits(32):08x}",
        "type": "function",
        "function": {"name": function["name"], "arguments": encoded},
    }
