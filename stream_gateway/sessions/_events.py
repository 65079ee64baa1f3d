"""A :class:`Turn` and its event form (``turn.completed``/``turn.aborted``), converted in one place.

The recorder publishes a finished turn with :func:`turn_to_event`; a replica that reads a turn
back from the events stream rebuilds it with :func:`turn_from_event`. What the event leaves out
the caller supplies: on the way out, the fields every event has (``event_id``, ``seq``, ``time``:
the recorder's), on the way back, what the shared session record holds (the turn's conversation
key and context length) and the parent turn whose ids the prompt starts with.

Deliberate choices:

* Events are built with ``model_construct``: this runs once per turn on the request path, the
  turn's data is already valid, and validating a 100k-id prompt would cost more than the publish.
* The event holds only the prompt ids after the reused prefix (``reused_prompt_tokens``): a long
  agent session would otherwise store its history once per turn. The prefix comes back from the
  parent turn, which is why turns are rebuilt parents first (:mod:`._replay`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.events import (
    ImageRecord,
    RoutedExperts,
    SamplingRecord,
    SignalRecord,
    ToolCallRecord,
    TurnAborted,
    TurnCompleted,
    Usage,
)

from stream_gateway.moe import decode_routes, encode_routes
from stream_gateway.sessions._ids import Logprobs, TokenIds
from stream_gateway.sessions._store import Turn, TurnImage, TurnSignal, prompt_after
from stream_gateway.tool_parsers import ToolCall

__all__ = ["TurnEvent", "turn_from_event", "turn_to_event"]

TurnEvent = TurnCompleted | TurnAborted


def turn_to_event(
    turn: Turn,
    common: Mapping[str, Any],
    *,
    request_id: str,
    choice_index: int,
    sampling: SamplingRecord,
    abort_reason: str | None = None,
    abort_detail: str | None = None,
) -> TurnEvent:
    """``turn.completed`` for a finished turn, ``turn.aborted`` (``abort_reason``, default
    ``cancelled``) otherwise; ``common``: the fields every event has, as the recorder sets them."""
    fields = {
        **common,
        "turn_id": turn.turn_id,
        "parent_turn_id": turn.parent_id,
        "request_id": request_id,
        "choice_index": choice_index,
        "reused_prompt_tokens": turn.reused_prompt_tokens,
        "prompt_ids": turn.prompt_ids[turn.reused_prompt_tokens :],
        "output_ids": turn.output_ids.tolist(),
        "logprobs": turn.logprobs.tolist(),
        "policy_versions": list(turn.policy_versions),
        "content": turn.content,
        "tool_calls": [
            ToolCallRecord.model_construct(id=c.id, name=c.name, arguments=c.arguments) for c in turn.tool_calls
        ],
        "usage": Usage.model_construct(prompt_tokens=len(turn.prompt_ids), completion_tokens=len(turn.output_ids)),
        "sampling": sampling,
        "started_at": turn.created_at,
        "time_to_first_token_s": turn.time_to_first_token_s,
        "duration_s": turn.duration_s,
        "matches_full_render": turn.matches_full_render,
        "fallback_reason": turn.fallback_reason,
        "predecessor_turn_id": turn.predecessor_id,
        "continues_turn_id": turn.continues_id,
        "continues_cause": "compacted" if turn.continues_id is not None else None,
        "cached_prompt_tokens": turn.cached_prompt_tokens,
        "length_cause": turn.length_cause,
        "reasoning_tokens": turn.reasoning_tokens,
        "answer_start": turn.answer_start,
        "routed_experts": _routes_record(turn),
        "adapter": turn.adapter,
        "images": [ImageRecord.model_construct(**_image_fields(image)) for image in turn.images],
        "signals": [
            SignalRecord.model_construct(turn_id=s.turn_id, signal=s.signal, detail=s.detail) for s in turn.signals
        ],
    }
    if turn.finish_reason is not None:
        return TurnCompleted.model_construct(**fields, finish_reason=turn.finish_reason)
    return TurnAborted.model_construct(
        **fields, reason=abort_reason or turn.abort_reason or "cancelled", detail=abort_detail
    )


def turn_from_event(
    event: TurnEvent,
    *,
    session_id: str,
    parent: Turn | None,
    key: bytes | None,
    context_length: int,
) -> Turn:
    """The :class:`Turn` ``event`` recorded; ``parent`` (the turn it continues) is needed when the
    event reused prompt ids, ``key`` and ``context_length`` come from the session record."""
    if event.reused_prompt_tokens and parent is None:
        raise ValueError(f"turn {event.turn_id} reuses its parent's ids: the parent is needed to rebuild it")
    return Turn(
        turn_id=event.turn_id,
        session_id=session_id,
        parent_id=event.parent_turn_id,
        key=key,
        context_length=context_length,
        prompt_ids=prompt_after(parent, event.reused_prompt_tokens, event.prompt_ids),
        reused_prompt_tokens=event.reused_prompt_tokens,
        output_ids=TokenIds(event.output_ids),
        logprobs=Logprobs(event.logprobs),
        finish_reason=event.finish_reason if isinstance(event, TurnCompleted) else None,
        content=event.content,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in event.tool_calls),
        policy_version=event.policy_version,
        policy_versions=tuple((int(v), int(i)) for v, i in event.policy_versions),
        created_at=event.started_at,
        time_to_first_token_s=event.time_to_first_token_s,
        duration_s=event.duration_s,
        matches_full_render=event.matches_full_render,
        fallback_reason=event.fallback_reason,
        predecessor_id=event.predecessor_turn_id,
        continues_id=event.continues_turn_id,
        cached_prompt_tokens=event.cached_prompt_tokens,
        length_cause=event.length_cause,
        reasoning_tokens=event.reasoning_tokens,
        answer_start=event.answer_start,
        **_routes_of(event.routed_experts),
        adapter=event.adapter,
        images=tuple(TurnImage(**record.model_dump()) for record in event.images),
        signals=tuple(TurnSignal(s.turn_id, s.signal, s.detail) for s in event.signals),
        abort_reason=event.reason if isinstance(event, TurnAborted) else None,
    )


def _image_fields(image: TurnImage) -> dict[str, Any]:
    return {name: getattr(image, name) for name in TurnImage.__dataclass_fields__}


def _routes_record(turn: Turn) -> RoutedExperts | None:
    if turn.routes is None:
        return None
    encoded = encode_routes(turn.routes)
    return RoutedExperts.model_construct(
        start=turn.routes_start, shape=tuple(encoded["shape"]), dtype=encoded["dtype"], data=encoded["data"]
    )


def _routes_of(record: RoutedExperts | None) -> dict[str, Any]:
    """A turn's routes from its event (none from a dense model's)."""
    if record is None:
        return {}
    routes = decode_routes({"shape": record.shape, "dtype": record.dtype, "data": record.data})
    return {"routes": routes, "routes_start": record.start}
