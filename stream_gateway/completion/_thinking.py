"""One choice's thinking, split off its sampled ids while they stream.

:class:`~stream_gateway.reasoning.ThinkingTracker` says which ids are thinking; this turns them
into thinking text with its own detokenizer (no stop strings: they apply to the answer), keeps
the tags out of every text, and drops the answer's leading whitespace (the template's, after
``</think>``) as a chat template drops it when it renders the turn back.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from stream_gateway.completion._text import TextAssembler
from stream_gateway.reasoning import ReasoningFormat, ThoughtText

__all__ = ["ThinkingStream"]


class ThinkingStream:
    """Feed every step's ids while :attr:`active`; pass the answer's text through :meth:`answer`.

    With ``split`` false (token-in routes, whose text is the raw output) nothing is split off and
    only the span is recorded.
    """

    __slots__ = ("_assembler", "_lead", "_tags", "_text", "active", "tracker")

    def __init__(self, fmt: ReasoningFormat, prompt_ids: Sequence[int], tokenizer: Tokenizer, split: bool) -> None:
        self.tracker = fmt.tracker(prompt_ids)
        self._tags = (fmt.start_id, fmt.end_id)
        self._assembler = TextAssembler(tokenizer) if split else None
        self._text = ThoughtText()
        self._lead = split  # the answer's leading whitespace is still to drop
        self.active = True  # thinking, or may yet start: steps go through feed

    @classmethod
    def of(
        cls, fmt: ReasoningFormat | None, prompt_ids: Sequence[int], tokenizer: Tokenizer, split: bool
    ) -> ThinkingStream | None:
        """A stream for one choice, or ``None`` when the model has no reasoning format."""
        return None if fmt is None else cls(fmt, prompt_ids, tokenizer, split)

    def feed(self, ids: Sequence[int]) -> tuple[str, Sequence[int]]:
        """A step's ids -> (thinking text that may be sent now, the ids that are answer)."""
        tracker = self.tracker
        cut = tracker.feed(ids)
        if not tracker.thinking:
            self.active = False
            if not tracker.reasoning_tokens:
                self._lead = False  # no thinking at all: the answer is as sampled
        if self._assembler is None or not cut:
            return "", ids
        inner = [t for t in ids[:cut] if t not in self._tags]
        return self._text.feed(self._assembler.feed(inner).text), ids[cut:]

    def answer(self, text: str) -> str:
        """The answer's text, its leading whitespace dropped until the first visible character."""
        if not self._lead or not text or self.active:
            return text
        text = text.lstrip()
        self._lead = not text
        return text

    @staticmethod
    def span_of(stream: ThinkingStream | None) -> tuple[int, int | None]:
        """``(reasoning_tokens, answer_start)`` so far (see :class:`~stream_gateway.reasoning.ThinkingTracker`);
        ``(0, 0)`` without a stream: no thinking, the answer from the first token."""
        if stream is None:
            return 0, 0
        return stream.tracker.reasoning_tokens, stream.tracker.answer_start
