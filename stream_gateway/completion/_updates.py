"""What a choice's producer hands to a response: one update per engine step, and their sum.

A :class:`ChoiceUpdate` is protocol-neutral: thinking and answer text, the token ids and logprobs behind it, tool-call
deltas, and at the end the finish reason, the policy-version spans and the stop string. Every wire
format's encoder (:mod:`stream_gateway.protocols`) turns updates into its own frames; a
:class:`ChoiceResult` folds them into a whole choice for non-streamed bodies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from stream_gateway.tool_parsers import ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from stream_gateway.engines import EngineStep

__all__ = ["ChoiceResult", "ChoiceUpdate"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceUpdate:
    """What one choice produced since its previous update; the last one has a finish reason."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]] | None
    finish_reason: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    version_spans: list[tuple[int, int]] | None = None  # final update: (version, first token index) spans
    stop_sequence: str | None = None  # final update: the stop string that ended it, if one did
    reasoning: str = ""  # thinking text (stream_gateway.reasoning), before ``text`` in the output
    reasoning_tokens: int = 0  # final update: output tokens that are thinking, tags included
    answer_start: int | None = 0  # final update: output index of the first answer token (None: none)
    # Final update, when the request asked for them (token-in ``return_routed_experts``): the
    # choice's routed experts [positions, layers, top_k] from the position it asked for on.
    routes: np.ndarray | None = None


@dataclass(slots=True)
class ChoiceResult:
    """A whole choice, accumulated from its updates (non-streaming responses and capture)."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None
    call_deltas: list[ToolCallDelta] = field(default_factory=list)
    version_spans: list[tuple[int, int]] | None = None  # (version, first token index) spans, once finished
    stop_sequence: str | None = None
    reasoning_parts: list[str] = field(default_factory=list)
    reasoning_tokens: int = 0
    answer_start: int | None = 0
    route_parts: list[np.ndarray] = field(default_factory=list)  # the engine steps' routes (mixtures of experts)
    routes_start: int = 0  # the position of route_parts' first row
    routes: np.ndarray | None = None  # the final update's routes (whole responses)
    cached_prompt_tokens: int | None = None  # the engine's prefix-cache reuse (its last step), if it says

    def take_extras(self, step: EngineStep) -> None:
        """What an engine step carries besides its tokens: routes, and the prefix-cache reuse."""
        if step.routes is not None:
            self.add_routes(step.routes, step.routes_start)
        if step.cached_prompt_tokens is not None:
            self.cached_prompt_tokens = step.cached_prompt_tokens

    def add(self, update: ChoiceUpdate) -> None:
        """Fold one update in."""
        if update.version_spans is not None:
            self.version_spans = update.version_spans
        if update.stop_sequence is not None:
            self.stop_sequence = update.stop_sequence
        self.text_parts.append(update.text)
        if update.reasoning:
            self.reasoning_parts.append(update.reasoning)
        self.call_deltas.extend(update.tool_calls)
        self.token_ids.extend(update.token_ids)
        self.logprobs.extend(update.logprobs)
        if update.top_logprobs is not None:
            self.top_logprobs.extend(update.top_logprobs)
        if update.finish_reason is not None:
            self.finish_reason = update.finish_reason
            self.reasoning_tokens, self.answer_start = update.reasoning_tokens, update.answer_start
            self.routes = update.routes

    def add_routes(self, routes: np.ndarray, start: int) -> None:
        """An engine step's routes; ``start``: the position of their first row, kept from the first step."""
        if not self.route_parts:
            self.routes_start = start
        self.route_parts.append(routes)

    def routes_from(self, position: int) -> np.ndarray | None:
        """The engine steps' routes from ``position`` on (``None``: none, or none from that early)."""
        if not self.route_parts:
            return None
        if position < self.routes_start:
            log.warning(
                "choice %d: routes start at position %d, after %d: none kept", self.index, self.routes_start, position
            )
            return None
        rows = self.route_parts[0] if len(self.route_parts) == 1 else np.concatenate(self.route_parts)
        return rows[position - self.routes_start :]

    @property
    def reasoning(self) -> str:
        """The whole thinking text (``""``: none)."""
        return "".join(self.reasoning_parts)

    def tool_calls(self) -> list[ToolCall]:
        """The complete tool calls, reassembled from their deltas."""
        calls: dict[int, list[str]] = {}
        for delta in self.call_deltas:
            entry = calls.setdefault(delta.index, [delta.id or "", delta.name or "", ""])
            entry[2] += delta.arguments
        return [ToolCall(i, name, arguments) for i, name, arguments in (calls[k] for k in sorted(calls))]
