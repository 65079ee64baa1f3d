"""Thinking in model output: where it is, token-aligned, while it streams.

Reasoning models (Qwen3, DeepSeek-R1 and their descendants) write ``<think> ... </think>`` before
the answer or the tool calls. A :class:`ReasoningFormat` names the two tags by their token ids,
and a :class:`ThinkingTracker` follows one choice's sampled ids and says, per engine step, how
many of them are thinking. The split is on token ids, never on text: both tags are single tokens
in every tokenizer a format accepts (checked when the format is resolved), so "the first answer
token" is an exact output index, and nothing about it depends on how text was detokenized.

Parsing never changes what is recorded: the sampled ids are the truth, the split is metadata
beside them (``reasoning_tokens``, ``answer_start``).

The formats, and the one way they differ:

- ``qwen3``: a choice thinks if its first sampled token is ``<think>``, or if the prompt already
  opened a ``<think>`` it did not close (templates that put ``<think>\\n`` in the generation prompt;
  with ``enable_thinking=false`` Qwen3's template closes an empty block there instead, and the
  whole output is answer).
- ``deepseek_r1``: a choice thinks from its first token until ``</think>`` unless the prompt's
  last tag is a closing one (DeepSeek-R1 sometimes omits the opening tag its template expects).

A choice that ends before ``</think>`` (``max_tokens``) is thinking to its end: no answer token,
``answer_start`` is ``None``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import TemplateError

__all__ = [
    "REASONING_PARSERS",
    "ReasoningFormat",
    "ThinkingSigner",
    "ThinkingTracker",
    "ThoughtText",
    "resolve_reasoning_format",
    "split_thinking",
]

log = logging.getLogger(__name__)

START_TAG = "<think>"
END_TAG = "</think>"

REASONING_PARSERS: tuple[str, ...] = ("auto", "deepseek_r1", "none", "qwen3")
"""The accepted ``--reasoning-parser`` values (``auto``: chosen from the tokenizer and template)."""


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A model's thinking tags, as token ids, and whether output starts inside thinking."""

    name: Literal["qwen3", "deepseek_r1"]
    start_id: int
    end_id: int
    start_tag: str = START_TAG
    end_tag: str = END_TAG

    def thinking_at_start(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a choice for ``prompt_ids`` starts inside thinking before sampling anything."""
        for token in reversed(prompt_ids):
            if token == self.start_id:
                return True  # the template opened a block the model is to continue
            if token == self.end_id:
                return False  # e.g. enable_thinking=false: an empty block closed in the prompt
        return self.name == "deepseek_r1"

    def tracker(self, prompt_ids: Sequence[int]) -> ThinkingTracker:
        """A fresh tracker for one choice of ``prompt_ids``."""
        return ThinkingTracker(self, self.thinking_at_start(prompt_ids))


# Tracker states: before the first token (a qwen3 choice may yet open <think>), thinking, answering.
_PENDING, _THINKING, _DONE = 0, 1, 2


class ThinkingTracker:
    """Follows one choice's ids; :meth:`feed` says how many of a step's ids are thinking.

    ``reasoning_tokens`` counts the output tokens that are thinking, tags included; ``answer_start``
    is the output index of the first answer token (``None`` while thinking, and for a choice that
    ended inside thinking).
    """

    __slots__ = ("_format", "_state", "answer_start", "reasoning_tokens")

    def __init__(self, fmt: ReasoningFormat, thinking: bool) -> None:
        self._format = fmt
        self._state = _THINKING if thinking else _PENDING
        self.reasoning_tokens = 0
        self.answer_start: int | None = None

    @property
    def thinking(self) -> bool:
        """Whether the next sampled token would be thinking (or may open it)."""
        return self._state != _DONE

    def feed(self, ids: Sequence[int]) -> int:
        """The next step's ids; returns ``k``: ``ids[:k]`` are thinking (tags included), the rest answer."""
        state = self._state
        if state == _DONE or not ids:
            return 0
        if state == _PENDING:
            if ids[0] != self._format.start_id:
                self._state = _DONE
                self.answer_start = 0
                return 0
            self._state = _THINKING
        try:
            cut = ids.index(self._format.end_id) + 1
        except ValueError:
            self.reasoning_tokens += len(ids)
            return len(ids)
        self._state = _DONE
        self.reasoning_tokens += cut
        self.answer_start = self.reasoning_tokens
        return cut


def split_thinking(
    fmt: ReasoningFormat | None, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> tuple[int, int | None]:
    """``(reasoning_tokens, answer_start)`` of a whole output: what streaming it would record."""
    if fmt is None:
        return 0, 0
    tracker = fmt.tracker(prompt_ids)
    tracker.feed(output_ids)
    return tracker.reasoning_tokens, tracker.answer_start


class ThoughtText:
    """Streamed thinking text, trimmed as chat templates trim it when they render it back.

    Newlines right after ``<think>`` and right before ``</think>`` are the template's, not the
    thought's (Qwen3 renders ``reasoning_content.strip("\\n")``): leading ones are dropped, trailing
    ones are held until more text shows they were inside the thought.
    """

    __slots__ = ("_held", "_started")

    def __init__(self) -> None:
        self._held = ""
        self._started = False

    def feed(self, text: str) -> str:
        """Decoded thinking text; returns what may be sent now."""
        if not self._started:
            text = text.lstrip("\n")
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip("\n")
        self._held = text[len(body) :]
        return body


def resolve_reasoning_format(setting: str, tokenizer: Any) -> ReasoningFormat | None:
    """The format ``--reasoning-parser`` names for this tokenizer (``auto``: chosen and logged).

    ``auto`` picks a format only when it is unambiguous: both tags are single tokens and the chat
    template mentions ``</think>``; ``deepseek_r1`` when its generation prompt opens ``<think>``
    itself, ``qwen3`` otherwise. A named format whose tags are not single tokens is an error: the
    split must be token-aligned.
    """
    if setting == "none":
        return None
    ids = _single_token_ids(tokenizer)
    if setting == "auto":
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        if ids is None or END_TAG not in template:
            log.info("reasoning parser: none (the model has no single-token %s/%s in its template)", START_TAG, END_TAG)
            return None
        name: Literal["qwen3", "deepseek_r1"] = "deepseek_r1" if _prompt_opens_thinking(tokenizer) else "qwen3"
        log.info("reasoning parser: %s (chosen from the chat template; --reasoning-parser overrides)", name)
        return ReasoningFormat(name, *ids)
    if setting not in ("qwen3", "deepseek_r1"):
        raise ValueError(f"unknown reasoning parser {setting!r}; available: {', '.join(REASONING_PARSERS)}")
    if ids is None:
        raise ValueError(
            f"--reasoning-parser {setting} needs {START_TAG} and {END_TAG} as single tokens; "
            "this model's tokenizer splits them (use --reasoning-parser none)"
        )
    return ReasoningFormat(setting, *ids)  # type: ignore[arg-type]


def _single_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    found = []
    for tag in (START_TAG, END_TAG):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) != 1:
            return None
        found.append(int(ids[0]))
    return found[0], found[1]


def _prompt_opens_thinking(tokenizer: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        )
    except (TemplateError, ValueError, TypeError):  # a template that cannot render this says nothing either way
        return False
    return isinstance(text, str) and text.rstrip().endswith(START_TAG)


SIGNATURE_PREFIX = "sgw1"


class ThinkingSigner:
    """Signatures on thinking handed to clients (Anthropic ``signature``, Responses ``encrypted_content``).

    A signature is ``sgw1.<ref>.<mac>``: ``ref`` names the response that produced the thinking,
    ``mac`` is an HMAC-SHA256 over ``ref`` and the thinking text, keyed per deployment
    (``--reasoning-key-file``; replicas that share sessions must share it). It lets the gateway
    tell its own thinking, echoed back, from a foreign or modified one; it carries no secret and
    is not needed to continue a conversation (the recorded ids are).
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the reasoning key must be at least 16 bytes")
        self._key = key

    @classmethod
    def from_file(cls, path: Any | None) -> ThinkingSigner:
        """The key in ``path`` (its bytes, surrounding whitespace stripped), or a random one."""
        if path is None:
            return cls(secrets.token_bytes(32))
        with open(path, "rb") as handle:
            return cls(handle.read().strip())

    def start(self, ref: str) -> Any:
        """An incremental MAC for ``ref``: ``update`` it with the thinking text as it streams, then :meth:`finish`."""
        return hmac.new(self._key, ref.encode() + b"\0", hashlib.sha256)

    @staticmethod
    def finish(ref: str, mac: Any) -> str:
        """The signature from a :meth:`start` MAC fed the whole thinking."""
        return f"{SIGNATURE_PREFIX}.{ref}.{base64.urlsafe_b64encode(mac.digest()).decode().rstrip('=')}"

    def sign(self, ref: str, thinking: str) -> str:
        """The signature of ``thinking`` produced by response ``ref``."""
        mac = self.start(ref)
        mac.update(thinking.encode())
        return self.finish(ref, mac)

    def check(self, signature: str, thinking: str) -> Literal["ours", "foreign", "modified"]:
        """Whose ``signature`` is: this deployment's over this very text, another system's, or
        this deployment's over a different text (the block was edited)."""
        prefix, _, rest = signature.partition(".")
        ref, _, _ = rest.rpartition(".")
        if prefix != SIGNATURE_PREFIX or not ref:
            return "foreign"
        return "ours" if hmac.compare_digest(self.sign(ref, thinking), signature) else "modified"
