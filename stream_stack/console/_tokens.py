"""Tokens exactly as training sees them: a trajectory's ids, each with the text it decodes to and
the kind of text it is, a page at a time.

Kinds, one per position (first match wins):

``image``      an image placeholder (the trajectory's ``images`` runs)
``thinking``   sampled, in the loss, and thinking (``reasoning_mask``)
``tool-call``  sampled, in the loss, inside a ``<tool_call>`` ... ``</tool_call>`` span
``sampled``    sampled and in the loss (``loss_mask`` 1)
``untrained``  sampled, but out of this row's loss: a turn another chain of the session trains
               (train-once), or an unfinished last turn the batcher masked
``template``   the chat template's own text: special tokens, a ChatML message's ``<|im_start|>role\\n``
``system``, ``prompt``, ``tool-result``   a message's text, by its role (a user message that opens
               with ``<tool_response>`` is a tool result, as Qwen-style templates write them)
``history``    an assistant message in the prompt that this chain did not sample (a new root that
               re-rendered a recorded history, or a client that sent a transcript)
``text``       anything else not sampled (a template that is not ChatML: no roles are known)

Roles come from ChatML's ``<|im_start|>`` (every built-in model, Qwen, SmolLM2); with another
template the kinds are ``sampled``/``thinking``/``tool-call``/``image``/``template``/``text``.
A trajectory's layout (message starts and roles, tool-call spans) is computed once, in one pass
over its ids, and kept with it (:class:`TokenView`); a page decodes only its own ids.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "TokenView", "Tokenizers"]

KINDS = (
    "image",
    "thinking",
    "tool-call",
    "sampled",
    "untrained",
    "template",
    "system",
    "prompt",
    "tool-result",
    "history",
    "text",
)

_ROLE_KINDS = {"system": "system", "user": "prompt", "tool": "tool-result", "assistant": "history"}


class Tokenizers:
    """The tokenizer of each served model name, loaded on first use from its directory."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = dict(paths)
        self._loaded: dict[str, Any] = {}

    def get(self, model: str) -> Any | None:
        if model in self._loaded:
            return self._loaded[model]
        path = self._paths.get(model) or (next(iter(self._paths.values())) if len(self._paths) == 1 else None)
        tokenizer = None
        if path is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        self._loaded[model] = tokenizer
        return tokenizer


@dataclass(slots=True)
class _Message:
    start: int  # position of its <|im_start|>
    body: int  # position of its first content token
    kind: str
    end: int | None = None  # position of its <|im_end|>; what follows it, up to the next message, is template


class TokenView:
    """One trajectory (its JSON dict, as the assembler published it) and its tokenizer's layout."""

    def __init__(self, data: dict[str, Any], tokenizer: Any | None) -> None:
        self.data = data
        self.tokenizer = tokenizer
        ids: list[int] = data["token_ids"]
        self.length = len(ids)
        self._special: frozenset[int] = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._images = sorted((image["start"], image["start"] + image["tokens"]) for image in data.get("images") or [])
        self._versions = _versions(data, self.length)
        self._untrained = sorted((t["start"], t["start"] + t["length"]) for t in data.get("turns") or []
                                 if t.get("trained") is False)  # fmt: skip
        self._messages: list[_Message] = []
        self._calls: list[tuple[int, int]] = []
        if tokenizer is not None:
            self._layout(ids)
        self._message_starts = [m.start for m in self._messages]

    def _layout(self, ids: list[int]) -> None:
        tok = self.tokenizer
        start_id, end_id = _single_id(tok, "<|im_start|>"), _single_id(tok, "<|im_end|>")
        call_open, call_close = _single_id(tok, "<tool_call>"), _single_id(tok, "</tool_call>")
        opened: int | None = None
        for i, token in enumerate(ids):
            if token == start_id:
                self._messages.append(self._message(ids, i))
            elif token == end_id and self._messages and self._messages[-1].end is None:
                self._messages[-1].end = i
            elif token == call_open and call_open is not None:
                opened = i
            elif token == call_close and opened is not None:
                self._calls.append((opened, i + 1))
                opened = None

    def _message(self, ids: list[int], start: int) -> _Message:
        tokenizer = self.tokenizer
        assert tokenizer is not None
        header = tokenizer.decode(ids[start + 1 : start + 8])
        role, _, _ = header.partition("\n")
        body = start + 1
        text = ""
        while body < min(len(ids), start + 8) and "\n" not in text:  # the role line ends at its newline
            text += tokenizer.decode([ids[body]])
            body += 1
        kind = _ROLE_KINDS.get(role.strip(), "text")
        if kind == "prompt" and tokenizer.decode(ids[body : body + 8]).lstrip().startswith("<tool_response>"):
            kind = "tool-result"
        return _Message(start, body, kind)

    def kind(self, i: int) -> str:
        data = self.data
        if self._inside(self._images, i):
            return "image"
        if data["loss_mask"][i]:
            reasoning = data.get("reasoning_mask")
            if reasoning and reasoning[i]:
                return "thinking"
            if self._inside(self._calls, i):
                return "tool-call"
            return "sampled"
        if self._inside(self._untrained, i):
            return "untrained"
        if data["token_ids"][i] in self._special:
            return "template"
        at = bisect.bisect_right(self._message_starts, i) - 1
        if at < 0:
            return "text"
        message = self._messages[at]
        if i < message.body or (message.end is not None and i >= message.end):
            return "template"
        return message.kind

    @staticmethod
    def _inside(spans: list[tuple[int, int]], i: int) -> bool:
        at = bisect.bisect_right(spans, (i, float("inf"))) - 1
        return at >= 0 and spans[at][0] <= i < spans[at][1]

    def page(self, offset: int, limit: int) -> dict[str, Any]:
        """Tokens ``[offset, offset + limit)``: id, text, kind, logprob (sampled only), version."""
        data = self.data
        end = min(self.length, offset + limit)
        ids = data["token_ids"][offset:end]
        texts = [self._text(t) for t in ids]
        tokens = []
        for i, (token, text) in enumerate(zip(ids, texts, strict=True), start=offset):
            sampled = bool(data["loss_mask"][i]) or self._inside(self._untrained, i)
            tokens.append({
                "i": i,
                "id": token,
                "text": text,
                "kind": self.kind(i),
                "special": token in self._special,
                "logprob": data["logprobs"][i] if sampled else None,
                "version": self._versions[i] if sampled else None,
            })  # fmt: skip
        return {"offset": offset, "length": self.length, "tokens": tokens}

    def _text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"⟨{token}⟩"
        return str(self.tokenizer.decode([token], skip_special_tokens=False))


def _single_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _versions(data: dict[str, Any], length: int) -> list[int]:
    """The policy version of every position (-1 where nothing was sampled), from the turns' spans."""
    versions = [-1] * length
    for turn in data.get("turns") or []:
        spans = turn.get("policy_versions") or [[turn["policy_version"], 0]]
        for k, (version, first) in enumerate(spans):
            upto = spans[k + 1][1] if k + 1 < len(spans) else turn["length"]
            for j in range(turn["start"] + first, min(length, turn["start"] + upto)):
                versions[j] = version
    return versions
