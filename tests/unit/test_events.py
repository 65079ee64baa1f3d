"""The event models: wire round trips, validation, prompts by reference, tenants and subject tokens."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from pipeline import events
from pipeline.events import (
    DURABLE_KINDS,
    EVENT_TYPES,
    Event,
    FeedbackRecorded,
    TurnAborted,
    TurnCompleted,
    TurnRecord,
    decode_event,
    encode_event,
    event_json_schemas,
    full_prompt_ids,
    new_event_id,
    subject_token,
    tenant_id,
)

from ..support.events import SAMPLING, one_of_each, turn_completed

_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def test_public_names() -> None:
    assert set(events.__all__) == {
        "DURABLE_KINDS",
        "EVENT_TYPES",
        "SCHEMA_VERSION",
        "AnyEvent",
        "Event",
        "FeedbackRecorded",
        "ImageRecord",
        "PolicyApplied",
        "PolicyObject",
        "PolicyRejected",
        "PolicyUpdated",
        "RoutedExperts",
        "SamplingRecord",
        "SessionClosed",
        "SessionOpened",
        "SignalRecord",
        "ToolCallRecord",
        "TurnAborted",
        "TurnCompleted",
        "TurnDelta",
        "TurnRecord",
        "TurnStarted",
        "Usage",
        "decode_event",
        "encode_event",
        "event_json_schemas",
        "full_prompt_ids",
        "new_event_id",
        "subject_token",
        "tenant_id",
    }


def test_samples_cover_every_kind() -> None:
    kinds = [e.kind for e in one_of_each()]
    assert sorted(kinds) == sorted(t.model_fields["kind"].default for t in EVENT_TYPES)
    assert set(event_json_schemas()) == set(kinds)


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: e.kind)
def test_every_kind_round_trips(event: Event) -> None:
    data = encode_event(event)
    assert isinstance(data, bytes)
    decoded = decode_event(data)
    assert type(decoded) is type(event)
    assert decoded == event
    assert decode_event(data.decode()) == event
    # The wire form is plain JSON: any JSON library reads it.
    assert json.loads(data)["kind"] == event.kind
    assert json.loads(data)["schema_version"] == 7


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: e.kind)
def test_model_construct_encodes_like_a_validated_event(event: Event) -> None:
    """The gateway builds events without validation; the bytes must not differ."""
    fields = {name: getattr(event, name) for name in type(event).model_fields}
    assert encode_event(type(event).model_construct(**fields)) == encode_event(event)


@pytest.mark.parametrize("event", [*one_of_each(), turn_completed("s", 3, prompt_ids=list(range(300)))],
                         ids=lambda e: e.kind)  # fmt: skip
def test_the_wire_form_is_what_model_dump_gives(event: Event) -> None:
    """``encode_event`` serializes the models' fields directly: byte for byte pydantic's own dump,
    nested models (usage, sampling, tool calls, images, signals, routes) included."""
    assert encode_event(event) == orjson.dumps(event.model_dump(mode="python"))
    fields = {name: getattr(event, name) for name in type(event).model_fields}
    built = type(event).model_construct(**fields)
    assert encode_event(built) == orjson.dumps(built.model_dump(mode="python"))


def test_encoding_refuses_what_json_cannot_hold() -> None:
    event = one_of_each()[0]
    odd = type(event).model_construct(**{**event.__dict__, "metadata": {"at": object()}})
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode_event(odd)


def test_events_are_frozen() -> None:
    event = one_of_each()[0]
    with pytest.raises(ValidationError):
        event.seq = 9


_DROP = object()


def _wire(event: Event, **changes: Any) -> bytes:
    data = orjson.loads(encode_event(event))
    data.update(changes)
    return orjson.dumps({k: v for k, v in data.items() if v is not _DROP})


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"kind": "turn.exploded"}, "kind"),
        ({"schema_version": 8}, "schema_version"),
        ({"seq": -1}, "seq"),
        ({"policy_version": "latest"}, "policy_version"),
        ({"event_id": _DROP}, "event_id"),
        ({"surprise": 1}, "surprise"),
        ({"finish_reason": "error"}, "finish_reason"),
        ({"output_ids": ["a"]}, "output_ids"),
        ({"usage": {"prompt_tokens": 1}}, "completion_tokens"),
        ({"tool_calls": [{"id": "c", "name": "read"}]}, "arguments"),
        ({"sampling": {**SAMPLING.model_dump(), "typical_p": 0.5}}, "typical_p"),
        ({"policy_versions": [[3, 1]]}, "policy_versions"),  # does not start at the first output id
        ({"policy_versions": [[3, 0], [4, 3]]}, "policy_versions"),  # past the 3 output ids
        ({"policy_versions": [[4, 0], [3, 1]]}, "policy_versions"),  # versions go down
        ({"policy_versions": _DROP}, "policy_versions"),  # schema 2 must carry them
    ],
)
def test_bad_payloads_raise_validation_error(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        decode_event(_wire(turn_completed(), **changes))


def test_per_token_policy_versions_expand_from_spans() -> None:
    turn = turn_completed(output_ids=[7, 8, 9, 10])
    assert turn.policy_versions == [(3, 0), (4, 1)]
    assert turn.token_policy_versions() == [3, 4, 4, 4]


def test_a_schema_1_turn_decodes_with_one_span() -> None:
    """Events written before per-token versions read as sampled wholly by their policy_version."""
    old = _wire(turn_completed(), schema_version=1, policy_versions=_DROP)
    decoded = decode_event(old)
    assert isinstance(decoded, TurnCompleted)
    assert decoded.policy_versions == [(3, 0)]
    assert decoded.token_policy_versions() == [3, 3, 3]


@pytest.mark.parametrize("data", [b"", b"not json", b"[]", b'{"kind": "session.opened"}', b"null"])
def test_garbage_raises_validation_error(data: bytes) -> None:
    with pytest.raises(ValidationError):
        decode_event(data)


def test_feedback_score_must_be_finite() -> None:
    base = one_of_each()[-2]
    assert isinstance(base, FeedbackRecorded)
    for score in (float("nan"), float("inf")):
        with pytest.raises(ValidationError, match="score"):
            FeedbackRecorded.model_validate({**base.model_dump(), "score": score})


def test_durable_kinds_are_everything_but_deltas() -> None:
    all_kinds = {t.model_fields["kind"].default for t in EVENT_TYPES}
    assert all_kinds - DURABLE_KINDS == {"turn.delta"}
    assert len(all_kinds) == 10
    durable = {"session.opened", "session.closed", "turn.started", "turn.completed", "turn.aborted"}
    policy = {"policy.updated", "policy.applied", "policy.rejected"}
    assert durable | {"feedback.recorded"} | policy == DURABLE_KINDS
    for event in one_of_each():
        assert event.durable == (event.kind != "turn.delta")


# -- prompts by reference ----------------------------------------------------------------------


def test_full_prompt_ids_of_a_root_is_its_prompt() -> None:
    root = turn_completed(prompt_ids=[5, 6, 7])
    assert full_prompt_ids(root, None) == [5, 6, 7]
    assert full_prompt_ids(root, [1, 2]) == [5, 6, 7]  # a root needs nothing from a parent


def test_full_prompt_ids_resolves_a_chain_of_turns() -> None:
    """Each turn's prompt is its parent's prompt + output, then what it appends."""
    root = turn_completed(turn_id="t1", prompt_ids=[1, 2, 3], output_ids=[10, 11])
    child = turn_completed(turn_id="t2", parent_turn_id="t1", reused=5, prompt_ids=[4], output_ids=[12])
    grandchild = turn_completed(turn_id="t3", parent_turn_id="t2", reused=7, prompt_ids=[5, 6], output_ids=[13])

    full: dict[str, list[int]] = {}  # turn id -> its prompt + output, what a child reuses
    for turn in (root, child, grandchild):
        parent = None if turn.parent_turn_id is None else full[turn.parent_turn_id]
        prompt = full_prompt_ids(turn, parent)
        full[turn.turn_id] = [*prompt, *turn.output_ids]

    assert full_prompt_ids(child, full["t1"]) == [1, 2, 3, 10, 11, 4]
    assert full_prompt_ids(grandchild, full["t2"]) == [1, 2, 3, 10, 11, 4, 12, 5, 6]


@pytest.mark.parametrize("parent", [None, [1, 2, 3, 10], [1, 2, 3, 10, 11, 99]])
def test_full_prompt_ids_rejects_a_missing_or_mismatched_parent(parent: list[int] | None) -> None:
    child = turn_completed(turn_id="t2", parent_turn_id="t1", reused=5, prompt_ids=[4])
    with pytest.raises(ValueError, match="t2 reuses 5 ids of t1"):
        full_prompt_ids(child, parent)


def test_turn_records_share_their_fields() -> None:
    assert issubclass(TurnCompleted, TurnRecord)
    assert issubclass(TurnAborted, TurnRecord)
    assert set(TurnCompleted.model_fields) - set(TurnAborted.model_fields) == {"finish_reason"}
    assert set(TurnAborted.model_fields) - set(TurnCompleted.model_fields) == {"reason", "detail"}


# -- tenants, subject tokens, ids --------------------------------------------------------------


@pytest.mark.parametrize("key", ["sk-test", "sk-" + "x" * 60, "key with spaces", "ключ", "sk.a.b>*"])
def test_tenant_never_contains_the_key(key: str) -> None:
    tenant = tenant_id(key)
    assert key not in tenant
    assert re.fullmatch(r"t[0-9a-f]{16}", tenant)
    assert tenant_id(key) == tenant  # stable across calls and processes
    assert subject_token(tenant) == tenant  # usable in a subject as is
    session = one_of_each(tenant=tenant)[0]
    assert key.encode() not in encode_event(session)


def test_tenants_of_different_keys_differ_and_no_key_is_anonymous() -> None:
    assert tenant_id("sk-a") != tenant_id("sk-b")
    assert tenant_id(None) == tenant_id("") == tenant_id("anonymous") == "anonymous"


@pytest.mark.parametrize("value", ["sess-1", "abc_DEF-123", "x" * 64, "42"])
def test_safe_session_ids_are_their_own_subject_token(value: str) -> None:
    assert subject_token(value) == value


@pytest.mark.parametrize(
    "value", ["", "a.b", "a b", "*", ">", "sess>", "x" * 65, "user@example.com", "séance", "a\tb", "a/b"]
)
def test_unsafe_session_ids_become_a_stable_digest(value: str) -> None:
    token = subject_token(value)
    assert re.fullmatch(r"h[0-9a-f]{24}", token)
    assert _SAFE_TOKEN.fullmatch(token)
    assert subject_token(value) == token
    assert subject_token(value + "!") != token


def test_event_ids_are_unique_and_subject_safe() -> None:
    ids = {new_event_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    assert all(re.fullmatch(r"ev[0-9a-f]{24}", i) for i in ids)


def test_a_forked_child_draws_other_event_ids() -> None:
    """``--workers`` forks: a child must not repeat its parent's ids (they deduplicate on JetStream)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, " ".join(new_event_id() for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        child = set(pipe.read().decode().split())
    parent = {new_event_id() for _ in range(100)}
    assert len(child) == 100
    assert not child & parent


def test_json_schemas_are_keyed_by_kind_and_pin_it() -> None:
    schemas = event_json_schemas()
    for kind, schema in schemas.items():
        assert schema["properties"]["kind"]["const"] == kind
        assert schema["additionalProperties"] is False
        assert {"event_id", "kind", "schema_version", "tenant", "session_id", "seq"} <= set(schema["required"])


def _routes(rows: int, start: int = 0, dtype: str = "uint8", size: int | None = None) -> dict[str, Any]:
    import base64

    width = 1 if dtype == "uint8" else 2
    data = base64.b64encode(bytes(size if size is not None else rows * 3 * 2 * width)).decode()
    return {"start": start, "shape": [rows, 3, 2], "dtype": dtype, "data": data}


def test_routed_experts_cover_exactly_the_positions_the_turn_ran_first() -> None:
    """A root's rows run from 0 to its last-but-one token; a continuation's from its parent's last token."""
    root = decode_event(_wire(turn_completed(), routed_experts=_routes(4 + 3 - 1)))
    assert isinstance(root, TurnCompleted) and root.routed_experts is not None
    assert root.routed_experts.shape == (6, 3, 2)
    child = turn_completed(turn_id="t2", parent_turn_id="t1", reused=7, prompt_ids=[4], output_ids=[12, 13])
    decode_event(_wire(child, routed_experts=_routes(3, start=6, dtype="uint16")))  # positions 6, 7, 8
    for routes, problem in [
        (_routes(5), "cover positions 0 to 6"),  # one row short
        (_routes(6, start=1), "cover positions 0 to 6"),
        (_routes(6, size=35), "does not hold 36 bytes"),
        ({**_routes(6), "dtype": "int32"}, "dtype"),
        ({**_routes(6), "shape": [6, 0, 2]}, "shape"),
    ]:
        with pytest.raises(ValidationError, match=problem):
            decode_event(_wire(turn_completed(), routed_experts=routes))
    assert decode_event(_wire(turn_completed())).routed_experts is None  # type: ignore[attr-defined]  # dense
