"""Sampled token ids to streamed text: never a split UTF-8 character, never a stop string.

:class:`TextAssembler` turns each step's token ids into the text that may be sent now.
Detokenization is ``tokenizers``' own ``DecodeStream``, which holds back a token until the bytes
it ends with form complete characters (byte-level BPE splits emoji and CJK across tokens).
Stop strings are matched on the text; whatever could still grow into a stop string is held back
until it is clear either way, so a stop string never reaches the client, even partially.

Deliberate choice: for a byte-level BPE tokenizer (GPT-2's decoder, which Llama 3, Qwen, DeepSeek
and the built-in models use) most tokens are whole characters on their own, and their text is the
same wherever they stand: the decoder only joins bytes. Such a token's text is looked up
(:class:`TokenTexts`, one table per tokenizer, filled as tokens are first seen) instead of asking
``DecodeStream``, which decodes a window of ids again for every token (a few microseconds in the
relay's per-token path). A token that is part of a character, and every token after it until
``DecodeStream`` has given the character out, still goes through ``DecodeStream``: its window then
lacks the looked-up tokens, which changes nothing, since what they decoded to was complete.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream


@dataclass(slots=True)  # not frozen: one is made per step, and frozen costs an object.__setattr__ per field
class TextDelta:
    """Text that may be sent now, and whether a stop string ended the generation."""

    text: str
    stopped: bool


class TokenTexts:
    """The text of each token of a byte-level BPE tokenizer that is whole characters on its own
    (special tokens: ""), filled as tokens are first asked for; shared by every choice."""

    __slots__ = ("_lock", "_texts", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str | None] = {}  # None: part of a character, for DecodeStream
        self._lock = threading.Lock()  # prompts build on worker threads; the loop reads (a dict read is atomic)

    def text(self, token: int) -> str | None:
        """``token``'s text, or ``None`` if it is not whole characters on its own."""
        try:
            return self._texts[token]
        except KeyError:
            return self._learn(token)

    def _learn(self, token: int) -> str | None:
        text: str | None = self._tokenizer.decode([token], skip_special_tokens=True)
        if text is not None and "\ufffd" in text:
            text = None
        with self._lock:
            self._texts[token] = text
        return text

    @staticmethod
    def of(tokenizer: Tokenizer) -> TokenTexts | None:
        """The table for ``tokenizer`` (made once), or ``None`` when its tokens' texts depend on where
        they stand (any decoder but byte-level: SentencePiece's, WordPiece's strip or join by context)."""
        key = id(tokenizer)
        known = _TABLES.get(key)
        if known is not None and known[0] is tokenizer:
            return known[1]
        table = TokenTexts(tokenizer) if isinstance(tokenizer.decoder, ByteLevel) else None
        if table is not None and not _looks_up_like_decode_stream(tokenizer, table):
            table = None
        with _TABLES_LOCK:
            if len(_TABLES) >= _TABLES_KEPT:
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[key] = (tokenizer, table)  # the tokenizer held too: its id is not reused while kept
        return table


_TABLES: dict[int, tuple[Tokenizer, TokenTexts | None]] = {}
_TABLES_LOCK = threading.Lock()
_TABLES_KEPT = 16


def _looks_up_like_decode_stream(tokenizer: Tokenizer, table: TokenTexts, tokens: int = 2048) -> bool:
    """Whether an assembler with ``table`` gives out what ``DecodeStream`` alone does, for a sample of
    the vocabulary in a shuffled order (a byte-level decoder does; this guards against one that
    does more than it says)."""
    vocabulary = tokenizer.get_vocab_size(with_added_tokens=True)
    sample = random.Random(0).sample(range(vocabulary), min(tokens, vocabulary))
    plain = DecodeStream(skip_special_tokens=True)
    expected = "".join(plain.step(tokenizer, token) or "" for token in sample)
    assembler = TextAssembler(tokenizer, texts=table)
    got = "".join(assembler.feed([token]).text for token in sample)
    return got == expected


class TextAssembler:
    """Incremental, stop-aware detokenizer for one choice."""

    __slots__ = (
        "_held",
        "_max_stop",
        "_pending",
        "_stop_hit",
        "_stops",
        "_stream",
        "_texts",
        "_tokenizer",
        "matched",
    )

    def __init__(
        self, tokenizer: Tokenizer, stops: Sequence[str] = (), *, texts: TokenTexts | bool | None = True
    ) -> None:
        """``texts``: the tokenizer's :class:`TokenTexts` (``True``: its own, if it has one; ``None``
        or ``False``: ``DecodeStream`` for every token)."""
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._texts = TokenTexts.of(tokenizer) if texts is True else (texts or None)
        self._pending = False  # DecodeStream holds part of a character
        self._stops = tuple(stops)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._stop_hit = False
        self.matched: str | None = None  # the stop string that ended the generation

    def _piece(self, token: int) -> str:
        texts = self._texts
        if texts is not None and not self._pending:
            text = texts.text(token)
            if text is not None:
                return text
        piece = self._stream.step(self._tokenizer, token)
        self._pending = piece is None and texts is not None
        return piece or ""

    def feed(self, token_ids: Sequence[int]) -> TextDelta:
        """Add sampled ids; return the text now safe to send."""
        if self._stop_hit:
            return TextDelta("", True)
        if len(token_ids) == 1 and not self._stops:  # a token a step, no stop strings: most steps
            return TextDelta(self._piece(token_ids[0]), False)
        pieces = []
        for token in token_ids:
            piece = self._piece(token)
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
