"""A turn's life beside the token loop: started, its live deltas, finished, and made durable.

:class:`TurnLifecycle` owns everything a choice does that is not sending tokens: the
``turn.started`` event, the live token deltas, the latency metrics, the tenant's token spend, the
:class:`~stream_gateway.sessions.Turn` record in the session tree, the ``turn.completed`` or
``turn.aborted`` event, and the wait until that event is durable and other replicas can find the
turn. The token loop (:mod:`._service`) only calls :meth:`TurnLifecycle.step` per engine step and
:meth:`TurnLifecycle.finish` once, whatever way the choice ended.

Deliberate choice: metrics that fire per step are gathered in lists and counted at the end (one
histogram call per turn, not per token); see ``benchmarks/hot_path.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stream_gateway._metrics import GatewayMetrics
from stream_gateway.capture import EventRecorder
from stream_gateway.completion._fingerprint import assistant_fingerprint, extend_key
from stream_gateway.completion._updates import ChoiceResult
from stream_gateway.engines import SamplingParams
from stream_gateway.sessions import (
    Logprobs,
    SessionDirectory,
    TokenIds,
    Turn,
    TurnImage,
    prompt_after,
    turn_routes,
)

if TYPE_CHECKING:
    from stream_gateway.completion._images import PromptImage
    from stream_gateway.completion._prepare import PreparedCompletion

__all__ = ["TurnLifecycle", "Turns"]


def _own_routes(result: ChoiceResult, reused: int) -> dict[str, Any]:
    """The turn's own rows of routes: the positions it ran first (``routes``, ``routes_start``).

    The engine ran the whole prompt; positions before ``reused - 1`` belong to the ancestors,
    which recorded them when they first ran them (the parent's last output token is run here
    first). The engine's rows start at ``result.routes_start`` (0 for in-process engines; a remote
    server may have been asked for fewer). A turn without routes (a dense model, a remote request
    that ended before the server sent them) or whose rows start too late records none (logged).
    """
    start = max(reused - 1, 0)
    rows = result.routes_from(start)
    return {} if rows is None else {"routes": rows, "routes_start": start}


def _turn_image(placed: PromptImage) -> TurnImage:
    image = placed.image
    return TurnImage(
        image.sha256,
        image.media_type,
        image.width,
        image.height,
        placed.start,
        image.tokens,
        image.grid_thw,
        image.pixels_sha256,
        image.processor,
    )


Spend = Callable[[str, int], None]
"""``(tenant, tokens)``: charges a tenant's token budget (the control plane's limiter)."""


@dataclass(frozen=True, slots=True)
class Turns:
    """What every turn reports to: events, sessions, metrics and the tenant's budget."""

    recorder: EventRecorder
    sessions: SessionDirectory
    metrics: GatewayMetrics
    spend: Spend | None
    durable_wait_s: float

    def begin(
        self, prepared: PreparedCompletion, index: int, params: SamplingParams, policy_version: int
    ) -> TurnLifecycle:
        """Start the turn of choice ``index`` (its ``turn.started`` event goes out now)."""
        return TurnLifecycle(self, prepared, index, params, policy_version)


class TurnLifecycle:
    """One choice's turn, from ``turn.started`` to its durable record."""

    __slots__ = (
        "_deltas",
        "_gaps",
        "_last",
        "_of",
        "first_token_s",
        "index",
        "params",
        "policy_version",
        "prepared",
        "turn_id",
    )

    def __init__(
        self, of: Turns, prepared: PreparedCompletion, index: int, params: SamplingParams, policy_version: int
    ) -> None:
        self._of = of
        self.prepared = prepared
        self.index = index
        self.params = params
        self.policy_version = policy_version
        self.turn_id = f"turn{secrets.token_hex(12)}"
        self.first_token_s: float | None = None
        self._gaps: list[float] = []  # between engine steps, counted into the histogram at the end
        self._last = prepared.arrived
        context = prepared.context
        of.recorder.turn_started(
            prepared.session,
            self.turn_id,
            context.parent.turn_id if context.parent is not None else None,
            prepared.completion_id,
            index,
            len(prepared.prompt_ids),
            context.reused_prompt_tokens,
            params,
            policy_version,
        )
        self._deltas = of.recorder.deltas(prepared.session, self.turn_id, policy_version)

    def step(self, ids: list[int], logprobs: list[float], now: float) -> None:
        """An engine step arrived at ``now``; ``ids``/``logprobs`` are the whole turn's so far."""
        if self.first_token_s is None:
            self.first_token_s = now - self.prepared.arrived
            self._of.metrics.time_to_first_token.observe(self.first_token_s)
        else:
            self._gaps.append(now - self._last)
        self._last = now
        if self._deltas is not None:
            self._deltas.advance(ids, logprobs, now)

    async def finish(
        self,
        result: ChoiceResult,
        spans: list[tuple[int, int]],
        abort_reason: str | None,
        abort_detail: str | None,
    ) -> None:
        """Record the turn however it ended; a completed one returns once it is durable and shared.

        The response ends (usage, ``[DONE]``) after this, so a crash cannot take back from the
        training data what the client already has, and other replicas can find the turn.
        """
        of, prepared = self._of, self.prepared
        ids = result.token_ids
        of.metrics.completion_tokens.inc(len(ids))
        if result.cached_prompt_tokens is not None:
            of.metrics.prompt_tokens_counted.inc(len(prepared.prompt_ids))
            of.metrics.prompt_tokens_cached.inc(result.cached_prompt_tokens)
        if of.spend is not None:
            of.spend(prepared.session.tenant, len(ids))
        of.metrics.inter_token_latency.observe_many(self._gaps)
        if self._deltas is not None:
            self._deltas.flush(ids, result.logprobs)
        turn = self._record(result, spans or [(self.policy_version, 0)], abort_reason)
        durable = of.recorder.turn_finished(
            prepared.session, turn, prepared.completion_id, self.index, self.params, abort_reason, abort_detail
        )
        shared = of.sessions.record_turn(prepared.session, turn)
        if prepared.kept is not None and turn.finish_reason is not None:
            prepared.kept.keep_turn(turn.turn_id)  # the next prompt of this rollout continues it (_prepare.py)
        if abort_reason is None:
            if durable is not None and not durable.is_set():
                with contextlib.suppress(TimeoutError):  # (asyncio's timeout: cheaper than anyio's scope)
                    async with asyncio.timeout(of.durable_wait_s):
                        await durable.wait()
            await of.sessions.wait_shared(shared)

    def _length_cause(self, result: ChoiceResult) -> str | None:
        """Why a ``length`` finish stopped: the client's ``max_tokens``, or the end of the context
        window (no cap asked for, a cap the window could not give, or the engine's own limit)."""
        if result.finish_reason != "length":
            return None
        asked = self.prepared.max_tokens_requested
        if len(result.token_ids) < self.params.max_tokens or asked is None or asked > self.params.max_tokens:
            return "context"
        return "max_tokens"

    def _record(self, result: ChoiceResult, policy_versions: list[tuple[int, int]], abort_reason: str | None) -> Turn:
        prepared = self.prepared
        content = "".join(result.text_parts)
        calls = tuple(result.tool_calls())
        key = None
        if result.finish_reason is not None and not prepared.token_in:
            fingerprint = assistant_fingerprint(content, [(c.name, c.arguments) for c in calls])
            key = extend_key(prepared.conversation_key, fingerprint)
        context = prepared.context
        duration = time.perf_counter() - prepared.arrived
        reused = context.reused_prompt_tokens if context.parent is not None else 0
        turn = Turn(
            turn_id=self.turn_id,
            session_id=prepared.session.session_id,
            parent_id=context.parent.turn_id if context.parent is not None else None,
            key=key,
            context_length=prepared.context_length,
            prompt_ids=_prompt(prepared.prompt_ids, context.parent, reused),
            reused_prompt_tokens=context.reused_prompt_tokens,
            output_ids=TokenIds(result.token_ids),
            logprobs=Logprobs(result.logprobs),
            finish_reason=result.finish_reason,
            content=content,
            tool_calls=calls,
            policy_version=policy_versions[0][0],
            policy_versions=tuple(policy_versions),
            created_at=time.time() - duration,
            time_to_first_token_s=self.first_token_s,
            duration_s=duration,
            matches_full_render=context.matches_full_render,
            fallback_reason=context.fallback_reason,
            predecessor_id=context.predecessor.turn_id if context.predecessor is not None else None,
            continues_id=context.continues.turn_id if context.continues is not None else None,
            head=prepared.head,
            cached_prompt_tokens=result.cached_prompt_tokens,
            length_cause=self._length_cause(result),
            reasoning_tokens=result.reasoning_tokens,
            answer_start=result.answer_start,
            **_own_routes(result, reused),
            adapter=self.params.adapter,
            images=tuple(_turn_image(placed) for placed in prepared.images),
            render_anchor=context.anchor,
            signals=prepared.signals,
            abort_reason=abort_reason if result.finish_reason is None else None,
            request_key=None if prepared.token_in else prepared.conversation_key,
            edit_key=prepared.edit_key,
        )
        if turn.routes is not None and context.parent is not None:
            self._compare_prefill(result, context.parent)
        return turn

    def _compare_prefill(self, result: ChoiceResult, parent: Turn) -> None:
        """Count how often this turn's prefill routed an ancestor's position differently from the
        recorded row (which stays: a position keeps the route of the pass that first ran it)."""
        recorded = turn_routes(self.prepared.session, parent)
        if recorded is None or not result.route_parts or result.routes_start != 0:
            return  # (an engine that sent only the new rows ran nothing twice)
        again = result.route_parts[0][: len(recorded)]
        if again.shape != recorded.shape:
            return
        differ = (np.sort(again, axis=-1) != np.sort(recorded, axis=-1)).any(axis=-1)  # [positions, layers]
        metrics = self._of.metrics
        metrics.route_rows_compared.inc(differ.size)
        if disagreeing := int(differ.sum()):
            metrics.route_rows_disagreeing.inc(disagreeing)


def _prompt(ids: Sequence[int], parent: Turn | None, reused: int) -> TokenIds:
    """The turn's prompt ids, packed: a continuation's context already built them on its parent's
    storage (``completion._context``); anything else is packed here, sharing the reused part."""
    if isinstance(ids, TokenIds):
        return ids
    return prompt_after(parent, reused, ids[reused:])
