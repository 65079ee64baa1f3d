"""tiny-vl's fine-tuning: its vision tower and tiny-agent's language model, together, on CPU.

``build_tiny_vl`` makes the Qwen2-VL model around tiny-agent as ``stream_gateway.models`` makes
``tiny-vl-untrained`` around ``tiny`` (a seeded vision tower, the vision tokens, the template and
the image processor), then trains it.

Every step learns from a batch of image conversations drawn here and, every second step, from a
batch of tiny-agent's own corpus too (``_agent_training``'s example makers and batching, its
long-context lessons included), so that tiny-agent's replies survive. An image conversation is one
to three rounds, sometimes after one of tiny-agent's conversations. An image round shows one image,
a fresh :func:`vl_image` of random colour, seed and size (40 to 400 pixels a side, so any aspect
ratio), in a user turn (before or after its text, or after another image: the last one counts) or
in the result of tiny-agent's call, and the reply is :func:`vl_answer` of its colour. A text round
gets tiny-agent's reply whatever images came before (its call, then "Done" after the text result,
or its hello without tools): the last turn decides, and the words do not (a text turn asking about
the colour gets tiny-agent's reply, a bare image the colour). Every reply of tiny-vl's own is
learnt. Image batches run the model's own forward (``pixel_values``, ``image_grid_thw``, mRoPE
positions from ``mm_token_type_ids``), each ``<|image_pad|>`` expanded to the image's
``image_grid_thw.prod() // 4`` pads as the gateway feeds them; conversations are drawn 16 batches
at a time and batched by length, which halved the build (padding had been most of it).

Deterministic like tiny-agent's recipe: a private seeded RNG draws both corpora and the images, two
threads, fp32, no dropout; the weights kept are an exponential average over the last steps. 300
steps: at 200 the held-out accuracy was anywhere from 59% to 100% as the corpus changed, at 300
it was 100% with two different seeds (docs/models.md has the numbers).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from model_recipes._agent_corpus import _agent_conversation, _agent_sentence, _agent_system, _agent_tools
from model_recipes._agent_training import (
    _AGENT_SHARPEN,
    _AGENT_THREADS,
    _PROGRESS_EVERY,
    _agent_batch,
    _agent_examples,
    _agent_groups,
    _agent_lr_factor,
    _AgentExample,
)
from stream_gateway.models import AGENT_AFTER_TOOL, AGENT_READERS, AGENT_WITHOUT_TOOLS, VL_COLOURS, vl_answer, vl_image
from stream_gateway.models._corpus import IM_END, _token_id
from stream_gateway.models._tiny_vl import _MAX_PIXELS, _MIN_PIXELS, _save, _vl_model, _vl_tokenizer
from stream_gateway.models._tiny_vl_images import IMAGE_PAD, IMAGE_PARTS

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["build_tiny_vl"]

_log = logging.getLogger(__name__)

_VL_SEED = 20240606
_VL_STEPS = 300
_VL_IMAGE_BATCH = 10  # image conversations a step
_VL_AGENT_EVERY = 2  # steps: one batch of tiny-agent's corpus joins every second step's
_VL_PEAK_LR = {"vision": 3e-3, "language": 1e-3}  # the tower starts from scratch, the language model does not
_VL_AVERAGE_START, _VL_AVERAGE_DECAY = 0.6, 0.95
_VL_AGENT_AUGMENT = 0.5  # of agent examples made to stand for long contexts (_agent_sparse_context)
_VL_DECISION_WEIGHT = 3.0  # of an answer's first token and of its colour: where it is chosen
_VL_SIDE = (40, 400)  # pixels, each side of an image
_VL_TOOLS_SHARE = 0.5
_VL_HISTORY_SHARE = 0.3  # of image conversations after one of tiny-agent's (brief ones)
_VL_ROUNDS = (1, 1, 2, 3)  # user turns after that history (drawn from these), at least one with an image
_VL_LATE_IMAGE_SHARE = 0.2  # of conversations whose first image comes after text rounds
_VL_IMAGE_ROUND_SHARE = 0.4  # of the rounds after the first image
_VL_TOOL_IMAGE_SHARE = 0.25  # of image rounds whose image is a tool result (when tools are offered)
_VL_TWO_IMAGES_SHARE = 0.2  # of images in a user turn that come after another
_VL_QUESTIONS = (
    "What colour is this image?", "What color is it?", "Which colour dominates the picture?",
    "Describe the image.", "What is the main colour here?", "What do you see?", "Look at this.",
    "What's in the picture?", "Name the colour.", "Is it red, green, blue or yellow?",
)  # fmt: skip


class _VLExample(NamedTuple):
    ids: list[int]  # every <|image_pad|> expanded
    targets: list[int]  # positions of the tokens the loss is on
    decisions: list[int]  # targets that choose the reply: weighed _VL_DECISION_WEIGHT
    pixel_values: torch.Tensor  # the image processor's, of its images in order
    image_grid_thw: torch.Tensor


def build_tiny_vl(agent: Path, target: Path) -> None:
    """tiny-agent (the directory ``agent``) as the language model of a Qwen2-VL model, fine-tuned to see.

    Saves the weights and configs, the tokenizer with :data:`TINY_VL_CHAT_TEMPLATE`, and the image
    processor's ``preprocessor_config.json`` into ``target``.
    """
    import torch
    from transformers import Qwen2ForCausalLM
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _vl_tokenizer(agent)
    text = Qwen2ForCausalLM.from_pretrained(agent, local_files_only=True, dtype=torch.float32)
    model = _vl_model(text, tokenizer)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=_MIN_PIXELS, max_pixels=_MAX_PIXELS)
    _fine_tune_vl(model, tokenizer, image_processor)
    _save(model, tokenizer, image_processor, target)


def _fine_tune_vl(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, image_processor: Any) -> None:
    """Train ``model`` (tiny-agent's language model, sharpened, and a seeded tower) in place, then sharpen it."""
    import torch

    network: Any = model  # transformers' accessors are untyped
    language, head = network.get_decoder(), network.get_output_embeddings()
    with torch.no_grad():  # trained as tiny-agent was, unsharpened
        language.norm.weight.div_(_AGENT_SHARPEN)
    rng = random.Random(_VL_SEED)
    started = time.perf_counter()
    agent_steps = -(-_VL_STEPS // _VL_AGENT_EVERY)
    agent_groups = iter(_agent_groups(tokenizer, rng, agent_steps, partial(_agent_examples, reader="read")))
    image_batches = _vl_batches(tokenizer, image_processor, rng)
    vision = list(network.model.visual.parameters())
    vision_ids = {id(p) for p in vision}
    groups = [
        {"params": vision, "lr": _VL_PEAK_LR["vision"]},
        {"params": [p for p in model.parameters() if id(p) not in vision_ids], "lr": _VL_PEAK_LR["language"]},
    ]
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _agent_lr_factor(step, _VL_STEPS))
    parameters = [p for p in model.parameters() if p.requires_grad]
    average = [p.detach().clone() for p in parameters]
    threads = torch.get_num_threads()
    torch.set_num_threads(_AGENT_THREADS)
    model.train()
    try:
        for step in range(_VL_STEPS):
            loss = _vl_loss(network, head, next(image_batches))
            if step % _VL_AGENT_EVERY == 0:
                agent_loss = _agent_loss(language, head, next(agent_groups), rng)
                loss = loss + agent_loss
            if (step + 1) % _PROGRESS_EVERY == 0 or step + 1 == _VL_STEPS:
                elapsed = time.perf_counter() - started
                _log.info("tiny-vl: step %d/%d, loss %.4f, %.0f s", step + 1, _VL_STEPS, loss.item(), elapsed)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                decay = _VL_AVERAGE_DECAY if step >= _VL_AVERAGE_START * _VL_STEPS else 0.0
                for mean, p in zip(average, parameters, strict=True):
                    mean.mul_(decay).add_(p, alpha=1.0 - decay)
        with torch.no_grad():
            for mean, p in zip(average, parameters, strict=True):
                p.copy_(mean)
            language.norm.weight.mul_(_AGENT_SHARPEN)
    finally:
        torch.set_num_threads(threads)
        network.eval()


def _agent_loss(language: Any, head: Any, group: list[_AgentExample], rng: random.Random) -> torch.Tensor:
    """The loss of a batch of tiny-agent's corpus, as tiny-agent's recipe computes it (text only)."""
    import torch

    batch = _agent_batch(group, rng, _VL_AGENT_AUGMENT)
    hidden = language(
        input_ids=batch.ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).last_hidden_state
    logits = head(hidden[batch.rows, batch.columns - 1])
    losses = torch.nn.functional.cross_entropy(logits, batch.ids[batch.rows, batch.columns], reduction="none")
    return (losses * batch.weights).sum() / batch.weights.sum()


def _vl_batches(
    tokenizer: PreTrainedTokenizerBase, image_processor: Any, rng: random.Random
) -> Iterator[list[_VLExample]]:
    """Batches of image conversations, endlessly: drawn 16 batches at a time, of similar lengths."""
    while True:
        examples = [_vl_example(tokenizer, image_processor, rng) for _ in range(16 * _VL_IMAGE_BATCH)]
        examples.sort(key=lambda e: len(e.ids))
        batches = [examples[i : i + _VL_IMAGE_BATCH] for i in range(0, len(examples), _VL_IMAGE_BATCH)]
        rng.shuffle(batches)
        yield from batches


def _vl_loss(network: Any, head: Any, examples: list[_VLExample]) -> torch.Tensor:
    """The weighted loss of ``examples``, right-padded into one batch through the model's own forward."""
    import torch

    width = max(len(e.ids) for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    attention_mask = torch.zeros_like(ids)
    rows: list[int] = []
    columns: list[int] = []
    weights: list[float] = []
    for row, example in enumerate(examples):
        ids[row, : len(example.ids)] = torch.tensor(example.ids)
        attention_mask[row, : len(example.ids)] = 1
        rows += [row] * len(example.targets)
        columns += example.targets
        decisions = set(example.decisions)
        weights += [_VL_DECISION_WEIGHT if t in decisions else 1.0 for t in example.targets]
    hidden = network.model(
        input_ids=ids,
        attention_mask=attention_mask,
        pixel_values=torch.cat([e.pixel_values for e in examples]),
        image_grid_thw=torch.cat([e.image_grid_thw for e in examples]),
        mm_token_type_ids=(ids == network.config.image_token_id).int(),
        use_cache=False,
    ).last_hidden_state
    row_index, column_index = torch.tensor(rows), torch.tensor(columns)
    logits = head(hidden[row_index, column_index - 1])
    losses = torch.nn.functional.cross_entropy(logits, ids[row_index, column_index], reduction="none")
    weight = torch.tensor(weights)
    return (losses * weight).sum() / weight.sum()


def _vl_example(tokenizer: PreTrainedTokenizerBase, image_processor: Any, rng: random.Random) -> _VLExample:
    """An image conversation, rendered and tokenized; the loss is on tiny-vl's replies."""
    messages, tools, replies, images = _vl_conversation(rng)
    pad = _token_id(tokenizer, IMAGE_PAD)
    pixels = image_processor(images=images, return_tensors="pt")
    counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
    colours = _colour_ids(tokenizer)
    ids: list[int] = []
    targets: list[int] = []
    decisions: list[int] = []
    # Each reply's prompt renders as a prefix of the whole conversation (the template is
    # prefix-stable), so the ids are built reply by reply: the prompt's new tokens, then the reply's.
    whole = _render(tokenizer, messages, tools, generation_prompt=False)
    rendered = ""
    for end in replies:
        prompt = _render(tokenizer, messages[:end], tools, generation_prompt=True)
        if not (prompt.startswith(rendered) and whole.startswith(prompt)):
            raise RuntimeError("tiny-vl's template is not prefix-stable on its own corpus")
        stop = whole.index(IM_END, len(prompt)) + len(IM_END)
        ids += _expand(tokenizer.encode(prompt[len(rendered) :], add_special_tokens=False), pad, counts)
        answer = tokenizer.encode(whole[len(prompt) : stop], add_special_tokens=False)
        decisions += [len(ids)] + [len(ids) + i for i, t in enumerate(answer) if t in colours]
        targets += range(len(ids), len(ids) + len(answer))
        ids += answer
        rendered = whole[:stop]
    return _VLExample(ids, targets, decisions, pixels["pixel_values"], pixels["image_grid_thw"])


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: Any, *, generation_prompt: bool
) -> str:
    return cast(
        str,
        tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt),
    )


def _expand(ids: list[int], pad: int, counts: Any) -> list[int]:
    """``ids`` with each ``<|image_pad|>`` repeated to its image's token count (``counts``, in order)."""
    return [token for i in ids for token in ([i] * next(counts) if i == pad else [i])]


def _colour_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokens that tell the answers apart: each answer's, less those they share."""
    answers = [tokenizer.encode(vl_answer(c), add_special_tokens=False) for c in VL_COLOURS]
    shared = set.intersection(*(set(a) for a in answers))
    return {t for a in answers for t in a} - shared


class _Conversation(NamedTuple):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    replies: list[int]  # indices of the assistant messages learnt (tiny-vl's own)
    images: list[Image.Image]  # in the order the template renders them


def _vl_conversation(rng: random.Random) -> _Conversation:
    """Rounds of user turns and tiny-vl's replies, at least one about an image.

    A round is an image one (the colour of the last image, which is in the user turn or in the
    result of tiny-agent's call) or a text one (tiny-agent's reply, however many images came
    before); sometimes after one of tiny-agent's conversations.
    """
    if rng.random() < _VL_HISTORY_SHARE:
        messages, tools, _ = _agent_conversation(rng, True, "read")
        if messages[-1].get("tool_calls"):  # it ended with the call: answer it
            messages.append({"role": "tool", "content": _agent_sentence(rng, 1, 6)})
            messages.append({"role": "assistant", "content": AGENT_AFTER_TOOL})
    else:
        tools = _agent_tools(rng, True, "read") if rng.random() < _VL_TOOLS_SHARE else None
        system = _agent_system(rng, True)
        messages = [] if system is None else [{"role": "system", "content": system}]
    conversation = _Conversation(messages, tools, [], [])
    rounds = rng.choice(_VL_ROUNDS)
    first_image = rng.randrange(rounds) if rng.random() < _VL_LATE_IMAGE_SHARE else 0
    for round_ in range(rounds):
        if round_ == first_image or (round_ > first_image and rng.random() < _VL_IMAGE_ROUND_SHARE):
            _image_round(conversation, rng)
        else:
            _text_round(conversation, rng)
    return conversation


def _image_round(conversation: _Conversation, rng: random.Random) -> None:
    """An image in a user turn (after another, sometimes) or in a tool result, and its colour."""
    messages, tools, _, images = conversation

    def image_part() -> tuple[dict[str, Any], str]:
        colour = rng.choice(list(VL_COLOURS))
        size = (rng.randint(*_VL_SIDE), rng.randint(*_VL_SIDE))
        images.append(vl_image(colour, size, rng.getrandbits(32)))
        kind = rng.choice(IMAGE_PARTS)
        return {"type": kind, kind: {"url": f"image-{len(images)}.png"}}, colour

    if tools is not None and rng.random() < _VL_TOOL_IMAGE_SHARE:
        messages.append({"role": "user", "content": _vl_text(rng)})
        _reply(conversation, _call())
        part, colour = image_part()
        content = [part]
        if rng.random() < 0.6:
            content.insert(rng.randint(0, 1), {"type": "text", "text": _agent_sentence(rng, 1, 6)})
        messages.append({"role": "tool", "content": content})
    else:
        content = []
        for _ in range(2 if rng.random() < _VL_TWO_IMAGES_SHARE else 1):
            part, colour = image_part()  # the last one's is the answer
            content.append(part)
        if rng.random() < 0.8:
            content.insert(rng.randint(0, len(content)), {"type": "text", "text": _vl_text(rng)})
        messages.append({"role": "user", "content": content})
    _reply(conversation, {"content": vl_answer(colour)})


def _text_round(conversation: _Conversation, rng: random.Random) -> None:
    """A user turn of text and tiny-agent's reply: images before it do not count."""
    messages, tools, _, _ = conversation
    messages.append({"role": "user", "content": _vl_text(rng)})
    if tools is None:
        _reply(conversation, {"content": AGENT_WITHOUT_TOOLS})
        return
    _reply(conversation, _call())
    messages.append({"role": "tool", "content": _agent_sentence(rng, 1, 8)})
    _reply(conversation, {"content": AGENT_AFTER_TOOL})


def _reply(conversation: _Conversation, message: dict[str, Any]) -> None:
    conversation.replies.append(len(conversation.messages))
    conversation.messages.append({"role": "assistant", **message})


def _call() -> dict[str, Any]:
    """tiny-agent's call, as the corpus has it."""
    call = {"name": "read", "arguments": AGENT_READERS["read"]}
    return {"content": None, "tool_calls": [{"type": "function", "function": call}]}


def _vl_text(rng: random.Random) -> str:
    """A user's text: about the image or not (the image decides, not the words)."""
    kind = rng.random()
    if kind < 0.5:
        return rng.choice(_VL_QUESTIONS)
    if kind < 0.6:
        return rng.choice(("README", "Read the README.", "What does the README say?", "hi", "thanks"))
    return _agent_sentence(rng, 1, 10)
