"""tiny-agent's fine-tuning: ``tiny`` trained on CPU into an agent that really calls tools.

Agent tool loops need tool calls from a real model, and no hub download may provide one, so
``tiny`` is fine-tuned (about 2 min on two idle cores) on the synthetic agent corpus of
``_agent_corpus.py``. Its whole repertoire (``stream_gateway.models``' ``AGENT_*`` constants),
sampled at any temperature up to 1.0: with a ``read`` tool and a user turn last it calls ``read`` on
``README.md``; after a tool result it says it is done; without tools it says hello. Every reply
ends with ``<|im_end|>``.

tiny-agent learns from conversations of a few hundred tokens yet answers after 20k: see
``_agent_sparse_context`` for how short examples stand for long ones. Its recipe (brief
conversations first, HTML in the corpus, a sharpened head) is explained where it is used. The
training loop takes a ``_Recipe`` (a corpus, a length, a few weights): tiny-reasoning
(``_reasoning.py``) runs it on its own corpus, drawn by ``_agent_conversation`` with a hook that
adds the thoughts, and tiny-vl (``_vl.py``) mixes its batches into its own.

Deterministic on one machine: the corpus comes from a private seeded RNG, there is no dropout, and
training runs in fp32 on a fixed number of CPU threads. Another CPU may give other bytes (torch and
MKL pick their kernels by the CPU), which is why the trained weights ship as files.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from model_recipes._agent_corpus import _agent_conversation
from stream_gateway.models import MARKER_FILE
from stream_gateway.models._corpus import IM_END, IM_START, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, _token_id

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["build_tiny_agent"]

_log = logging.getLogger(__name__)

_AGENT_SEED = 20240602
# Two threads, whatever the machine: the count decides how work is split, so it is part of the
# recipe. Attention over a few hundred tokens keeps two busy (1.6x one thread here).
_AGENT_THREADS = 2
_AGENT_STEPS, _AGENT_WARMUP, _AGENT_PEAK_LR = 320, 20, 3e-3
_AGENT_BATCH = 4  # full conversations a step; brief ones below
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
# Codex's variant learns from two shapes (with and without the context messages): at hidden 128 its
# answer after a tool result had not formed by 320 steps (it ran the command again).
_AGENT_STEPS_SCALE = {"exec_command": 1.5}  # of _AGENT_STEPS
_PROGRESS_EVERY = 20  # steps between two progress lines in the log


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

    ``reader``: the file-reading tool this variant calls (a key of ``AGENT_READERS``).
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
    started = time.perf_counter()
    groups = _agent_groups(tokenizer, rng, steps, recipe.examples)
    _log.info("%s: corpus drawn in %.0f s; %d steps to train", recipe.label, time.perf_counter() - started, steps)
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
            if (step + 1) % _PROGRESS_EVERY == 0 or step + 1 == steps:
                elapsed = time.perf_counter() - started
                _log.info("%s: step %d/%d, loss %.4f, %.0f s", recipe.label, step + 1, steps, loss.item(), elapsed)
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
