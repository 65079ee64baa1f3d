"""Chains: the token-exact sequence of one root-to-leaf path of a session's turn tree.

A chain is what the last turn of the path saw plus what it sampled: the first turn's prompt,
then for every turn its sampled ids, then the ids the next turn appended (tool results, user
messages, template text), and so on. Alongside the ids, a loss mask (1 exactly on sampled ids)
and logprobs (each sampled id's, 0.0 on prompt ids), and a reasoning mask (1 exactly on sampled
ids that are a reasoning model's thinking, ``<think>``/``</think>`` included: each turn's first
``reasoning_tokens`` output ids). The gateway shows chains in
``GET /sessions/{id}``; the assembler publishes them as trajectories. :func:`chain_tokens` is
the one place that lays a chain out, so the two cannot drift apart.

Deliberate choices:

* **Two forms of a turn's prompt, one layout.** The gateway keeps each turn's *whole* prompt;
  ``turn.completed`` events carry only what a turn *appended* after its parent's prompt and
  output (``reused_prompt_tokens`` counts the rest, see :mod:`pipeline.events`). The caller
  says which form its turns hold (``prompts=``): the layout is the same.
* **Joining is checked by the caller, not here.** In the whole form, a turn's prompt is trusted
  to start with everything before it in the chain (the gateway compares ids before it makes a
  turn a child), and only the ids past that length are added. In the appended form the caller
  has already matched ``reused_prompt_tokens`` against the parent's ids (the assembler leaves a
  turn that does not add up out of the tree). So nothing is ever spliced or compared twice.
* **Nothing else is checked either.** Logprobs are taken as given, one per sampled id; a
  mismatch shows as misaligned lengths, which the batcher refuses as malformed.
* Turns are read through :class:`ChainTurn`, a protocol, so the gateway's frozen ``Turn`` and the
  events' ``TurnRecord`` both fit without either knowing this module; the result is immutable.

A vision-language chain's images (:func:`chain_images`) are its leaf turn's, each earlier turn
listing exactly those that lie in its prompt, and they must sit in the chain's ids as runs of one
placeholder (:func:`images_problem`): the assembler builds trajectories with them, and a
trajectory checks its own with the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pipeline.events import ImageRecord

__all__ = ["ChainTurn", "ImagedTurn", "TokenChain", "chain_images", "chain_tokens", "images_problem"]


class ChainTurn(Protocol):
    """What :func:`chain_tokens` reads of a turn."""

    @property
    def turn_id(self) -> str: ...

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[float]: ...

    @property
    def reasoning_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TokenChain:
    """A chain's ids with their loss mask and logprobs aligned, and where each turn sits in them."""

    turn_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 on sampled ids, 0 on prompt ids
    logprobs: tuple[float, ...]  # the sampled ids' logprobs, 0.0 on prompt ids
    reasoning_mask: tuple[int, ...]  # 1 on sampled ids that are thinking, 0 elsewhere
    prompt_length: int  # the first turn's prompt: everything before its first sampled id
    output_starts: tuple[int, ...]  # per turn: the index in token_ids of its first sampled id


def chain_tokens(turns: Iterable[ChainTurn], *, prompts: Literal["whole", "appended"] = "whole") -> TokenChain:
    """Lay out a root-to-leaf path of turns, root first (see the module docstring).

    ``prompts="whole"``: each turn's ``prompt_ids`` is its whole prompt, starting with the chain so
    far (the gateway's turns). ``prompts="appended"``: each turn's ``prompt_ids`` is what it appended
    after its parent's prompt and output, the root's being its whole prompt (``turn.completed``
    events). No turns: an empty chain.
    """
    turn_ids: list[str] = []
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    reasoning: list[int] = []
    starts: list[int] = []
    prompt_length = 0
    for turn in turns:
        new_prompt = turn.prompt_ids[len(tokens) :] if prompts == "whole" else turn.prompt_ids
        tokens.extend(new_prompt)
        mask.extend([0] * len(new_prompt))
        logprobs.extend([0.0] * len(new_prompt))
        reasoning.extend([0] * len(new_prompt))
        if not turn_ids:
            prompt_length = len(tokens)
        turn_ids.append(turn.turn_id)
        starts.append(len(tokens))
        tokens.extend(turn.output_ids)
        mask.extend([1] * len(turn.output_ids))
        logprobs.extend(turn.logprobs)
        thinking = min(turn.reasoning_tokens, len(turn.output_ids))
        reasoning.extend([1] * thinking)
        reasoning.extend([0] * (len(turn.output_ids) - thinking))
    return TokenChain(
        turn_ids=tuple(turn_ids),
        token_ids=tuple(tokens),
        loss_mask=tuple(mask),
        logprobs=tuple(logprobs),
        reasoning_mask=tuple(reasoning),
        prompt_length=prompt_length,
        output_starts=tuple(starts),
    )


class ImagedTurn(Protocol):
    """What :func:`chain_images` reads of a turn (an event's ``TurnRecord``)."""

    @property
    def turn_id(self) -> str: ...

    @property
    def reused_prompt_tokens(self) -> int: ...

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def images(self) -> Sequence[ImageRecord]: ...


def chain_images(chain: Sequence[ImagedTurn], token_ids: Sequence[int]) -> list[ImageRecord]:
    """The images of a chain whose ids are ``token_ids`` (appended prompts): its leaf turn's, checked.

    A :class:`ValueError` says why they cannot be the chain's: an earlier turn whose ``images``
    are not the leaf's that lie in its prompt, or runs that are not placeholder runs
    (:func:`images_problem`).
    """
    leaf = chain[-1]
    images = list(leaf.images)
    for turn in chain[:-1]:
        prompt = turn.reused_prompt_tokens + len(turn.prompt_ids)
        if list(turn.images) != [image for image in images if image.start < prompt]:
            raise ValueError(
                f"turn {turn.turn_id} lists {len(turn.images)} images, not those of turn {leaf.turn_id} that lie "
                "in its prompt"
            )
    if (problem := images_problem(token_ids, images)) is not None:
        raise ValueError(problem)
    return images


def images_problem(token_ids: Sequence[int], images: Sequence[ImageRecord]) -> str | None:
    """What is wrong with ``images`` as the images of ``token_ids``; ``None``: nothing.

    In order, apart (a template puts text between images, and the model's ``get_rope_index`` takes
    one run of placeholders for one image) and within the ids; each run ``tokens`` copies of one
    placeholder id, the same for every image, which appears nowhere else in ``token_ids`` (so the
    runs are whole, and no sampled or tool id is taken for an image's slot). Which id that is the
    processor's record says (``token_id``); the batcher checks it there.
    """
    if not images:
        return None
    placeholder = token_ids[images[0].start] if images[0].start < len(token_ids) else None
    end = 0
    for i, image in enumerate(images):
        image_end = image.start + image.tokens
        if image.start < end or (i and image.start == end) or image_end > len(token_ids):
            return (
                f"images[{i}] at {image.start}..{image_end} overlaps or touches the one before, or is outside "
                f"the {len(token_ids)} token ids"
            )
        if any(token != placeholder for token in token_ids[image.start : image_end]):
            return f"images[{i}]: token ids {image.start}..{image_end} are not {image.tokens} placeholder ids"
        end = image_end
    found = sum(token == placeholder for token in token_ids)
    expected = sum(image.tokens for image in images)
    if found != expected:
        return f"the placeholder id {placeholder} appears {found} times in token_ids for images of {expected} tokens"
    return None
