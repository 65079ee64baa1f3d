"""Sample events for tests: the common fields, a finished turn, and one event of every kind."""

from __future__ import annotations

from typing import Any

from pipeline.events import (
    Event,
    FeedbackRecorded,
    PolicyApplied,
    PolicyObject,
    PolicyRejected,
    PolicyUpdated,
    SamplingRecord,
    SessionClosed,
    SessionOpened,
    ToolCallRecord,
    TurnAborted,
    TurnCompleted,
    TurnDelta,
    TurnStarted,
    Usage,
    new_event_id,
    tenant_id,
)

TENANT = tenant_id("sk-test")
SAMPLING = SamplingRecord(temperature=0.7, top_p=0.95, top_k=0, max_tokens=64, seed=None)


def common(session_id: str | None = "sess-1", seq: int = 0, tenant: str = TENANT) -> dict[str, Any]:
    """The fields every event has."""
    return {
        "event_id": new_event_id(),
        "time": 1_750_000_000.25,
        "tenant": tenant,
        "session_id": session_id,
        "seq": seq,
        "model": "tiny",
        "policy_version": 3,
    }


def turn_completed(
    session_id: str = "sess-1",
    seq: int = 2,
    *,
    turn_id: str = "turn-1",
    parent_turn_id: str | None = None,
    reused: int = 0,
    prompt_ids: list[int] | None = None,
    output_ids: list[int] | None = None,
    tenant: str = TENANT,
) -> TurnCompleted:
    """A finished turn; a root unless ``parent_turn_id`` and ``reused`` say otherwise."""
    prompt = [1, 2, 3, 4] if prompt_ids is None else prompt_ids
    output = [7, 8, 9] if output_ids is None else output_ids
    return TurnCompleted(
        **common(session_id, seq, tenant),
        turn_id=turn_id,
        parent_turn_id=parent_turn_id,
        request_id=f"chatcmpl-{turn_id}",
        choice_index=0,
        reused_prompt_tokens=reused,
        prompt_ids=prompt,
        output_ids=output,
        logprobs=[-0.5] * len(output),
        policy_versions=[(3, 0), (4, 1)] if len(output) > 1 else [(3, 0)],
        content="hi",
        tool_calls=[ToolCallRecord(id="call_1", name="read", arguments='{"path": "a.txt"}')],
        usage=Usage(prompt_tokens=reused + len(prompt), completion_tokens=len(output)),
        sampling=SAMPLING,
        started_at=1_750_000_000.0,
        time_to_first_token_s=0.01,
        duration_s=0.2,
        matches_full_render=True,
        fallback_reason=None,
        finish_reason="tool_calls",
    )


def one_of_each(session_id: str = "sess-1", tenant: str = TENANT) -> list[Event]:
    """One event of every kind, in the order a session produces them (``seq`` from 0)."""
    completed = turn_completed(session_id, 3, tenant=tenant)
    aborted_fields = completed.model_dump(exclude={"kind", "finish_reason", "event_id", "seq", "turn_id"})
    return [
        SessionOpened(**common(session_id, 0, tenant), agent="pytest/1.0", metadata={"group": "g1"}),
        PolicyUpdated(
            **common(None, 0, "_"),
            previous_version=2,
            weights="/ckpt/step-3",
            bucket="sg_policies",
            objects=[PolicyObject(name="v0000000003/model.safetensors", sha256="ab" * 32, size=1024)],
        ),
        PolicyApplied(
            **common(None, 0, "_"),
            replica="host-1",
            previous_version=2,
            source="nats",
            tensors=12,
            download_s=0.5,
            apply_s=0.02,
            pause_s=0.004,
            copy_s=0.001,
            in_flight=2,
        ),
        PolicyRejected(
            **common(None, 0, "_"),
            replica="host-2",
            rejected_version=2,
            reason="not_newer",
            detail="version 2 is not above the current 3",
        ),
        TurnStarted(
            **common(session_id, 1, tenant),
            turn_id="turn-1",
            parent_turn_id=None,
            request_id="chatcmpl-turn-1",
            choice_index=0,
            prompt_tokens=4,
            reused_prompt_tokens=0,
            sampling=SAMPLING,
        ),
        TurnDelta(**common(session_id, 2, tenant), turn_id="turn-1", offset=0, token_ids=[7, 8], logprobs=[-0.1, -0.2]),
        completed,
        TurnAborted(
            **aborted_fields,
            event_id=new_event_id(),
            seq=4,
            turn_id="turn-2",
            reason="client_disconnected",
            detail="peer closed",
        ),
        FeedbackRecorded(**common(session_id, 5, tenant), turn_id="turn-1", score=1.0, label="good", comment="nice"),
        SessionClosed(**common(session_id, 6, tenant), reason="client", turns=2),
    ]
