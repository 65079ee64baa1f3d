"""Sampled token ids to streamed text: never a split UTF-8 character, never a stop string.

:class:`TextAssembler` turns each step's token ids into the text that may be sent now.
Detokenization is ``tokenizers``' own ``DecodeStream``, which holds back a token until the bytes
it ends with form complete characters (byte-level BPE splits emoji and CJK across tokens).
Stop strings are matched on the text; whatever could still grow into a stop string is held back
until it is clear either way, so a stop string never reaches the client, even partially.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass(slots=True)  # not frozen: one is made per step, and frozen costs an object.__setattr__ per field
class TextDelta:
    """Text that may be sent now, and whether a stop string ended the generation."""

    text: str
    stopped: bool


class TextAssembler:
    """Incremental, stop-aware detokenizer for one choice."""

    __slots__ = ("_held", "_max_stop", "_stop_hit", "_stops", "_stream", "_tokenizer", "matched")

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stops = tuple(stops)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._stop_hit = False
        self.matched: str | None = None  # the stop string that ended the generation

    def feed(self, token_ids: Sequence[int]) -> TextDelta:
        """Add sampled ids; return the text now safe to send."""
        if self._stop_hit:
            return TextDelta("", True)
        if len(token_ids) == 1 and not self._stops:  # a token a step, no stop strings: most steps
            return TextDelta(self._stream.step(self._tokenizer, token_ids[0]) or "", False)
        pieces = []
        for token in token_ids:
            piece = self._stream.step(self._tokenizer, token)
            if piece:
                pieces.append(piece)
        if not self._stops:
            return TextDelta("".join(pieces), False)
        text = self._held + "".join(pieces)
        cut = _earliest_stop(text, self._stops)
        if cut is not None:
            self._held = ""
            self._stop_hit = True
            self.matched = next(s for s in self._stops if text.find(s) == cut)
            return TextDelta(text[:cut], True)
        keep = _partial_stop_suffix(text, self._stops, self._max_stop)
        self._held = text[len(text) - keep :] if keep else ""
        return TextDelta(text[: len(text) - keep], False)

    def flush(self) -> str:
        """Text held back for a possible stop string, released because generation ended."""
        held, self._held = self._held, ""
        return held


def _earliest_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _partial_stop_suffix(text: str, stops: Sequence[str], max_stop: int) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    for size in range(min(len(text), max_stop - 1), 0, -1):
        tail = text[-size:]
        if any(stop.startswith(tail) for stop in stops):
            return size
    return 0
