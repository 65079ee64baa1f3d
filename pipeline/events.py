"""The event contract between the gateway and its consumers: versioned pydantic models, orjson bytes.

Every event carries ``schema_version``, a ``kind``, a unique ``event_id`` (published as
``Nats-Msg-Id``, so a replay is deduplicated), the wall-clock ``time`` it happened, the tenant,
the session and, for turn events, the turn and its parent turn, the model and the policy version.

Kinds (the ``kind`` field, also the last two subject tokens)::

    session.opened      a session got its first turn
    session.closed      closed by the client, evicted as idle, or the gateway shut down
    turn.started        a generation was admitted: its prompt size and sampling parameters
    turn.delta          live tier only: a few sampled tokens, coalesced (never in the stream)
    turn.completed      the whole generation: prompt ids, sampled ids, logprobs, tool calls, usage
    turn.aborted        the same record for a generation that did not finish (client gone, error)
    feedback.recorded   a reward for a turn or a whole session, from a live user or a program
    policy.updated      a trainer published new weights (in the policy object store) for every replica
    policy.applied      one gateway replica now samples from a new policy version
    policy.rejected     one gateway replica refused a published policy and kept its weights

Deliberate choices:

* **Prompts by reference.** A turn that continues a parent turn starts with exactly the parent's
  prompt ids followed by the parent's sampled ids (the gateway's token-exactness contract), so
  ``turn.completed`` carries only what it appends: ``prompt_ids`` are the ids after the first
  ``reused_prompt_tokens``, which are the parent's ``prompt + output``. A root turn
  (``parent_turn_id`` null) carries its whole prompt and ``reused_prompt_tokens`` is 0.
  :func:`full_prompt_ids` resolves a turn given its parent's full ids. An agent loop of n turns
  therefore publishes O(total tokens), not O(n * context).
* **``seq``** numbers the durable events of one session from 0 in the order the gateway produced
  them. The stream keeps publication order, which equals ``seq`` order unless a fault sent
  events through the disk outbox; consumers that must not care sort by ``seq``.
* **Tenants are not API keys.** ``tenant`` is a short non-reversible digest of the caller's key
  (:func:`tenant_id`), so subjects and payloads never carry a secret.
* **Per-token policy versions** (schema 2). Weights can change between two decode steps of a
  turn in flight; ``policy_versions`` on ``turn.completed``/``turn.aborted`` lists
  ``[version, first_output_index]`` spans covering the output in order, so every sampled id is
  labelled with the weights that sampled it. Schema-1 events (written before) decode with one
  span, ``[[policy_version, 0]]``.
* **Thinking spans and predecessors** (schema 3). A reasoning model's turn says where its thinking
  ends: ``reasoning_tokens`` (output ids from the first, ``<think>``/``</think>`` included) and
  ``answer_start`` (the first answer id; null when the turn ended inside thinking). A root turn
  that a known turn's conversation continues, but that could not extend its ids (a template that
  drops earlier thinking under ``--reasoning-history template``, or any ``fallback_reason``),
  names that turn in ``predecessor_turn_id``. Older events decode with no thinking (0, 0) and no
  predecessor.
* **Routed experts** (schema 4). A mixture-of-experts turn carries ``routed_experts``: the experts
  that routed the positions it ran *first* (never the reused prefix, whose rows its ancestors
  carry): rows from ``start`` (0 for a root, the parent's last output token otherwise) to the
  turn's last-but-one token, ``[rows, layers, top_k]`` uint8/uint16, base64 in ``data``. An
  event over the server's max payload (a long turn's routes: ~384 bytes per token on
  Qwen3-30B-A3B) goes to the object store whole, as any large event (:mod:`pipeline.publisher`).
  Older events and dense models have none. The same schema names the LoRA adapter that sampled a
  turn (``adapter``; null: the base model), whose versions its ``policy_versions`` are.
* **Images** (schema 5). A vision-language model's turn lists every image of its prompt in
  ``images``, in order (the reused prefix's too): the SHA-256 of its bytes (stored once, before
  the event, as ``images/<sha256>`` in the image bucket), where its placeholder tokens sit in the
  prompt, the processor's grid, the SHA-256 of the ``pixel_values`` the model consumed and the
  processor's fingerprint (``processors/<fingerprint>`` in the same bucket holds its
  configuration). A consumer rebuilds the vision inputs from those and checks the pixel digest
  (docs/images.md). Older events and text-only turns have none.
* **Signals about earlier turns** (schema 7). What a request says about turns before it is known
  only when it arrives, and an event is never rewritten: so the *later* turn's record carries it,
  naming the earlier turn, in ``signals`` (``retried``: this request repeats that turn's request;
  ``edited``: it replaces the user message that led to that turn; ``tool_error``: a tool result in
  it reports the failure of a call that turn made). Consumers fold them onto the turn they name
  (:mod:`consumers.signals`). Older events carry none.
* Models are frozen; the gateway builds them with ``model_construct`` (its data is already
  valid), consumers decode them with full validation (:func:`decode_event`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import re
import secrets
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from pipeline.routes import routes_problem

__all__ = [
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
    "SamplingRecord",
    "SessionClosed",
    "SessionOpened",
    "RoutedExperts",
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
]

SCHEMA_VERSION: Literal[7] = 7

_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Serialization-mode JSON Schemas mark defaulted fields required: the wire always carries them.
_MODEL_CONFIG = ConfigDict(frozen=True, extra="forbid", json_schema_serialization_defaults_required=True)


# Event ids must be unique (they are JetStream's deduplication ids), not secret: a generator seeded
# from the OS's random source, and seeded again in a forked child (``--workers``), gives 96 random
# bits without a system call each (every live delta takes one).
_ids = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _ids.seed(secrets.randbits(128)))


def new_event_id() -> str:
    """A unique event id: 24 hex digits, 96 random bits."""
    return f"ev{_ids.getrandbits(96):024x}"


def tenant_id(api_key: str | None) -> str:
    """The tenant of an API key as it appears in events and subjects: never the key itself."""
    if not api_key or api_key == "anonymous":
        return "anonymous"
    return "t" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def subject_token(value: str) -> str:
    """``value`` if it is a safe NATS subject token, else a digest of it (stable, prefixed ``h``)."""
    if _SAFE_TOKEN.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:24]


class Event(BaseModel):
    """Fields every event has."""

    model_config = _MODEL_CONFIG

    schema_version: Literal[1, 2, 3, 4, 5, 6, 7] = Field(
        SCHEMA_VERSION,
        description="bumped when the contract changes (2: per-token policy versions; 3: thinking spans and "
        "predecessor links; 4: routed experts and LoRA adapters; 5: images; 6: compaction links, cached prompt "
        "tokens, length causes; 7: signals about earlier turns, feedback authors)",
    )
    kind: str = Field(description="what happened, e.g. `turn.completed`; also the last two subject tokens")
    event_id: str = Field(description="unique; published as Nats-Msg-Id, so replays are deduplicated")
    time: float = Field(description="when it happened, Unix seconds")
    tenant: str = Field(description="digest of the caller's API key ('anonymous' without one)")
    session_id: str | None = Field(description="null only for events that belong to no session")
    seq: int = Field(ge=0, description="position among the session's durable events, from 0")
    model: str = Field(description="the served model name")
    policy_version: int = Field(ge=0, description="the engine's weights version when the event happened")

    @property
    def durable(self) -> bool:
        """Whether the event goes to the JetStream stream (all but ``turn.delta``)."""
        return self.kind in DURABLE_KINDS


class SessionOpened(Event):
    """A session got its first turn."""

    kind: Literal["session.opened"] = "session.opened"
    agent: str | None = Field(None, description="the client's User-Agent header, if any")
    metadata: dict[str, str] = Field(
        default_factory=dict, description="the first request's `metadata` (e.g. a GRPO `group`)"
    )


class SessionClosed(Event):
    """No more turns will be added to this session."""

    kind: Literal["session.closed"] = "session.closed"
    reason: Literal["client", "idle", "evicted", "shutdown"] = Field(
        description="closed by the client, idle too long, evicted to make room, or the gateway shut down"
    )
    turns: int = Field(ge=0, description="turns recorded in the session")
    expected_seqs: list[tuple[int, int]] | None = Field(
        None,
        description="the session's durable events before this one, as [first, end) ranges of `seq`, when "
        "several gateway replicas wrote it (each numbers from its own block); null: every `seq` below this one",
    )


class SamplingRecord(BaseModel):
    """The sampling parameters a turn ran with."""

    model_config = _MODEL_CONFIG

    temperature: float = Field(description="the engine's temperature (the request's, or the default)")
    top_p: float = Field(description="nucleus sampling mass; 1.0: no cut")
    top_k: int = Field(description="0 (or -1): no top-k cut")
    max_tokens: int = Field(description="the most output tokens the turn could sample")
    seed: int | None = Field(description="the request's seed; null: unseeded")
    constraint: Literal["json_schema", "json_object", "tool_call"] | None = Field(
        default=None,
        description="constrained decoding: what the output was held to (response_format json_schema or "
        "json_object; tool_choice required or named: tool_call); null: unconstrained. The logprobs of a "
        "constrained turn are of the masked distribution: replay the grammar to recompute them",
    )
    grammar: str | None = Field(
        default=None,
        description="the llguidance grammar of a constrained turn, as stream_gateway.constraints.replay_masks takes it",
    )


class TurnStarted(Event):
    """A generation was admitted to the engine."""

    kind: Literal["turn.started"] = "turn.started"
    turn_id: str = Field(description="unique id of the turn (one generation of one choice)")
    parent_turn_id: str | None = Field(description="the turn this one continues; null: a root")
    request_id: str = Field(description="the chat completion id the client received")
    choice_index: int = Field(ge=0, description="which of the request's `n` choices")
    prompt_tokens: int = Field(ge=0, description="length of the whole prompt in tokens")
    reused_prompt_tokens: int = Field(ge=0, description="leading prompt ids that are the parent's prompt + output")
    sampling: SamplingRecord = Field(description="the sampling parameters it runs with")


class TurnDelta(Event):
    """A few freshly sampled tokens (live tier: coalesced, best-effort, never stored)."""

    kind: Literal["turn.delta"] = "turn.delta"
    turn_id: str = Field(description="the turn the tokens belong to")
    offset: int = Field(ge=0, description="position of the first token in the turn's output")
    token_ids: list[int] = Field(description="the ids sampled since the previous delta")
    logprobs: list[float] = Field(description="one per token id")


class ToolCallRecord(BaseModel):
    """A tool call as the client received it."""

    model_config = _MODEL_CONFIG

    id: str = Field(description="the tool call id sent to the client")
    name: str = Field(description="the function name")
    arguments: str = Field(description="the arguments exactly as sent (a JSON text)")


class Usage(BaseModel):
    """Token counts as reported to the client."""

    model_config = _MODEL_CONFIG

    prompt_tokens: int = Field(ge=0, description="the whole prompt, reused ids included")
    completion_tokens: int = Field(ge=0, description="the sampled ids")


class RoutedExperts(BaseModel):
    """The experts that routed the positions a turn ran first (mixture-of-experts models)."""

    model_config = _MODEL_CONFIG

    start: int = Field(ge=0, description="position (in prompt + output) of the first row")
    shape: tuple[int, int, int] = Field(description="[rows, MoE layers, experts per token (top_k)]")
    dtype: Literal["uint8", "uint16"] = Field(description="the expert ids' type: uint8 up to 256 experts")
    data: str = Field(description="standard base64 of the C-order array")

    @model_validator(mode="after")
    def _data_of_the_right_size(self) -> RoutedExperts:
        if (problem := routes_problem(self.shape, self.dtype, self.data)) is not None:
            raise ValueError(problem)
        return self


class ImageRecord(BaseModel):
    """One image of a turn's prompt (vision-language models, docs/images.md)."""

    model_config = _MODEL_CONFIG

    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="of the image's bytes: `images/<sha256>` in the image bucket"
    )
    media_type: str = Field(description="image/png, image/jpeg, image/webp or image/gif (its first frame)")
    width: int = Field(ge=1, description="pixels, as sent")
    height: int = Field(ge=1, description="pixels, as sent")
    start: int = Field(ge=0, description="position of its first placeholder token in the whole prompt")
    tokens: int = Field(ge=1, description="placeholder tokens it takes in the prompt")
    grid_thw: tuple[int, int, int] = Field(description="the processor's patch grid: time, height, width")
    pixels_sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="of the float32 pixel values the model consumed (C order)"
    )
    processor: str = Field(description="fingerprint of the image processor: `processors/<fingerprint>` in the bucket")


class SignalRecord(BaseModel):
    """What a turn's request says about an earlier turn of its session (schema 7, docs/rewards.md)."""

    model_config = _MODEL_CONFIG

    turn_id: str = Field(description="the earlier turn the signal is about")
    signal: Literal["retried", "edited", "tool_error"] = Field(
        description="`retried`: this request repeats that turn's request (a regenerate); `edited`: it replaces "
        "the user message that led to that turn; `tool_error`: a tool result in it reports the failure of a call "
        "that turn made"
    )
    detail: str | None = Field(None, description="for `tool_error`: the tool call's id and the result's first words")


class TurnRecord(Event):
    """A generation, token-exact: what ``turn.completed`` and ``turn.aborted`` share."""

    turn_id: str = Field(description="unique id of the turn; a child turn names it as its parent")
    parent_turn_id: str | None = Field(description="the turn this one continues; null: a root")
    request_id: str = Field(description="the chat completion id the client received")
    choice_index: int = Field(ge=0, description="which of the request's `n` choices")
    reused_prompt_tokens: int = Field(
        ge=0, description="the prompt starts with the parent's prompt ids + output ids, this many in all"
    )
    prompt_ids: list[int] = Field(description="the prompt ids after the reused ones (the whole prompt for a root)")
    output_ids: list[int] = Field(description="the ids the engine sampled, in order")
    logprobs: list[float] = Field(description="one per output id: the processed logprob it was sampled with")
    policy_versions: list[tuple[int, int]] = Field(
        description="[version, first output index] spans covering output_ids in order: the weights that "
        "sampled each id (one span unless weights changed mid-turn)"
    )
    content: str = Field(description="the assistant text sent to the client")
    tool_calls: list[ToolCallRecord] = Field(default_factory=list, description="parsed from the output, in order")
    usage: Usage = Field(description="token counts as reported to the client")
    sampling: SamplingRecord = Field(description="the sampling parameters it ran with")
    started_at: float = Field(description="Unix seconds the request arrived")
    time_to_first_token_s: float | None = Field(description="seconds from arrival to the first token; null: none")
    duration_s: float = Field(description="seconds from arrival to the end of the generation")
    matches_full_render: bool = Field(description="the prompt equals a fresh tokenization of the conversation")
    fallback_reason: str | None = Field(description="why a matching parent turn could not be continued")
    predecessor_turn_id: str | None = Field(
        None,
        description="a root that a known turn's conversation continues (parent_turn_id is null, fallback_reason "
        "says why): that turn; null otherwise",
    )
    reasoning_tokens: int = Field(
        0, ge=0, description="the first output ids that are thinking, <think> and </think> included (0: none)"
    )
    answer_start: int | None = Field(
        0,
        ge=0,
        description="output index of the first answer token (after </think>); null: the turn ended while "
        "thinking, with no answer token",
    )
    adapter: str | None = Field(
        None,
        description="the LoRA adapter that sampled this turn (policy_versions are its versions); null: the base model",
    )
    length_cause: Literal["max_tokens", "context"] | None = Field(
        None,
        description="for finish_reason `length`: the client's max_tokens, or the end of the context window "
        "(`context`); null otherwise, and in events before schema 6",
    )
    cached_prompt_tokens: int | None = Field(
        None,
        ge=0,
        description="prompt tokens the engine reused from its prefix cache (vLLM's cached_tokens; 0 for the "
        "transformers engine, which never reuses); null: the engine does not say (schema 6)",
    )
    continues_turn_id: str | None = Field(
        None,
        description="a new root that carries on the session's conversation after the client replaced its history "
        "(an agent's compaction): the latest turn of the conversation it replaced; null: none (schema 6)",
    )
    continues_cause: Literal["compacted"] | None = Field(
        None, description="why it continues that turn: `compacted` (same system prompt and tools, a shorter history)"
    )
    signals: list[SignalRecord] = Field(
        default_factory=list,
        description="what this turn's request says about earlier turns of the session: retried, edited, a failed "
        "tool call (schema 7; empty: nothing)",
    )
    routed_experts: RoutedExperts | None = Field(
        None,
        description="mixture-of-experts models: the experts that routed the positions this turn ran first, "
        "from `start` to its last-but-one token (earlier rows are its ancestors'); null: a dense model",
    )
    images: list[ImageRecord] = Field(
        default_factory=list,
        description="vision-language models: every image of the prompt in order, the reused prefix's too "
        "(schema 5; empty: none)",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_span_before_schema_2(cls, data: Any) -> Any:
        if isinstance(data, dict) and "policy_versions" not in data and data.get("schema_version") == 1:
            return {**data, "policy_versions": [(data.get("policy_version", 0), 0)]}
        return data

    @model_validator(mode="after")
    def _spans_cover_the_output(self) -> TurnRecord:
        spans = self.policy_versions
        if not spans:
            raise ValueError("policy_versions needs at least one span")
        if spans[0][1] != 0:
            raise ValueError("policy_versions must start at output index 0")
        for (v0, i0), (v1, i1) in itertools.pairwise(spans):
            if not (i0 < i1 < len(self.output_ids)) or v1 <= v0:
                raise ValueError("policy_versions spans must start at increasing output indices with rising versions")
        if self.reasoning_tokens > len(self.output_ids):
            raise ValueError("reasoning_tokens cannot exceed the output")
        if self.answer_start is None:
            if self.reasoning_tokens != len(self.output_ids):
                raise ValueError("answer_start is null only when the whole output is thinking")
        elif self.answer_start != self.reasoning_tokens:
            raise ValueError("answer_start must follow the thinking (equal reasoning_tokens)")
        routes = self.routed_experts
        if routes is not None:
            end = self.reused_prompt_tokens + len(self.prompt_ids) + len(self.output_ids) - 1
            if routes.start != max(self.reused_prompt_tokens - 1, 0) or routes.start + routes.shape[0] != end:
                raise ValueError(
                    f"routed_experts must cover positions {max(self.reused_prompt_tokens - 1, 0)} to {end}, "
                    f"not {routes.start} to {routes.start + routes.shape[0]}"
                )
        prompt = self.reused_prompt_tokens + len(self.prompt_ids)
        end = 0
        for image in self.images:
            if image.start < end or image.start + image.tokens > prompt:
                raise ValueError("images must be in prompt order, each within the prompt")
            end = image.start + image.tokens
        return self

    def token_policy_versions(self) -> list[int]:
        """The policy version of every output id, expanded from the spans."""
        out: list[int] = []
        spans = self.policy_versions or [(self.policy_version, 0)]
        for i, (version, start) in enumerate(spans):
            end = spans[i + 1][1] if i + 1 < len(spans) else len(self.output_ids)
            out.extend([version] * (end - start))
        return out


class TurnCompleted(TurnRecord):
    """A generation that finished."""

    kind: Literal["turn.completed"] = "turn.completed"
    finish_reason: Literal["stop", "length", "tool_calls"] = Field(description="as sent to the client")


class TurnAborted(TurnRecord):
    """A generation that did not finish; its output so far is kept."""

    kind: Literal["turn.aborted"] = "turn.aborted"
    reason: Literal["client_disconnected", "engine_error", "shutdown", "cancelled"] = Field(
        description="why it stopped (shutdown: the gateway stopped and the turn outlasted its grace period)"
    )
    detail: str | None = Field(None, description="more about the reason, e.g. the engine's error")


class FeedbackRecorded(Event):
    """A reward for one turn or a whole session."""

    kind: Literal["feedback.recorded"] = "feedback.recorded"
    turn_id: str | None = Field(description="null: the feedback is about the whole session")
    score: float = Field(allow_inf_nan=False, description="the reward: any finite number, higher is better")
    label: str | None = Field(None, description="a short category chosen by whoever gave the feedback")
    comment: str | None = Field(None, description="free text from whoever gave the feedback")
    source: str = Field(
        "user", description="who gave it: 'user' (a live user), 'console' (a person) or a program's name"
    )
    author: str | None = Field(
        None,
        description="the person who gave it, as the giver names them (the console: the signed-in tenant); "
        "null: not said (schema 7)",
    )


class PolicyObject(BaseModel):
    """One file of a published policy, as stored in the policy object store."""

    model_config = _MODEL_CONFIG

    name: str = Field(description="the object's name in the bucket, e.g. `v00000007/model.safetensors`")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the file's bytes")
    size: int = Field(ge=0, description="bytes")


class PolicyUpdated(Event):
    """A trainer published new weights; every gateway following the stream applies them.

    ``policy_version`` is the new version. ``objects`` are safetensors files in the object store
    ``bucket``: a whole state dict when ``full``, else only the tensors that changed since the
    previous version.
    """

    kind: Literal["policy.updated"] = "policy.updated"
    previous_version: int | None = Field(None, description="the version these weights follow, if the publisher knows")
    weights: str | None = Field(None, description="where the weights came from (a path, a trainer step)")
    bucket: str | None = Field(None, description="the JetStream object store holding `objects`")
    objects: list[PolicyObject] = Field(default_factory=list, description="the safetensors files, with digests")
    format: Literal["safetensors"] = Field("safetensors", description="the files' format")
    full: bool = Field(True, description="a whole state dict; false: only the tensors that changed")
    adapter: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="a LoRA adapter's name: `objects` are a PEFT adapter directory (adapter_config.json, "
        "adapter_model.safetensors), `policy_version` that adapter's version (published on "
        "`<prefix>.events._.adapters.policy.updated`); null: the base model",
    )


class PolicyApplied(Event):
    """One gateway replica applied a policy; `policy_version` is the version it now samples from."""

    kind: Literal["policy.applied"] = "policy.applied"
    replica: str = Field(description="the gateway replica (host-pid, or --replica-id)")
    previous_version: int = Field(ge=0, description="the version it sampled from before")
    source: str = Field(description="`nats` (a policy.updated event) or the local path of POST /policy/weights")
    tensors: int = Field(ge=0, description="tensors copied into the model")
    download_s: float = Field(ge=0, description="seconds to fetch and verify the objects (0 for a local path)")
    apply_s: float = Field(ge=0, description="seconds from the weights being read to decoding with them")
    pause_s: float = Field(ge=0, description="the longest pause of decoding it caused: copy + KV recompute")
    copy_s: float = Field(ge=0, description="of which the in-memory copy of the tensors")
    in_flight: int = Field(ge=0, description="requests that were decoding across the swap (none aborted)")
    adapter: str | None = Field(
        None,
        description="the LoRA adapter updated (`policy_version`, `previous_version` and `tensors`, the modules "
        "it targets, are that adapter's; previous_version 0: a new adapter or the one it started with); null: "
        "the base model",
    )


class PolicyRejected(Event):
    """One gateway replica refused a policy; `policy_version` is the version it keeps serving."""

    kind: Literal["policy.rejected"] = "policy.rejected"
    replica: str = Field(description="the gateway replica (host-pid, or --replica-id)")
    rejected_version: int = Field(description="the version it refused")
    reason: Literal[
        "not_newer",
        "digest_mismatch",
        "download_failed",
        "unreadable",
        "unknown_tensors",
        "shape_mismatch",
        "target_mismatch",
        "unsupported",
        "too_many",
        "engine",
    ] = Field(
        description="why (adapters also: `target_mismatch`, a module the base lacks or not a Linear; `unsupported`, "
        "an engine without LoRA or an adapter beyond plain LoRA; `too_many`, no room for a new adapter)"
    )
    detail: str = Field(description="what exactly was wrong")
    adapter: str | None = Field(
        None,
        description="the LoRA adapter refused (`policy_version` is the version of it kept, 0 if none); "
        "null: the base model",
    )


AnyEvent = Annotated[
    SessionOpened
    | SessionClosed
    | TurnStarted
    | TurnDelta
    | TurnCompleted
    | TurnAborted
    | FeedbackRecorded
    | PolicyUpdated
    | PolicyApplied
    | PolicyRejected,
    Field(discriminator="kind"),
]

EVENT_TYPES: tuple[type[Event], ...] = (
    SessionOpened,
    SessionClosed,
    TurnStarted,
    TurnDelta,
    TurnCompleted,
    TurnAborted,
    FeedbackRecorded,
    PolicyUpdated,
    PolicyApplied,
    PolicyRejected,
)
DURABLE_KINDS = frozenset(t.model_fields["kind"].default for t in EVENT_TYPES) - {"turn.delta"}

_ADAPTER: TypeAdapter[Any] = TypeAdapter(AnyEvent)


def _fields(value: object) -> dict[str, Any]:
    """A model's fields, for orjson: the models have no aliases, serializers or extras, so a model's
    ``__dict__`` (its fields in declaration order, ``model_construct``'s too) is what ``model_dump``
    returns, without copying a turn's lists of ids element by element (about 2.5x faster)."""
    if isinstance(value, BaseModel):
        return value.__dict__
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_event(event: Event) -> bytes:
    """The event's wire form: compact JSON via orjson (byte for byte what ``model_dump`` would give)."""
    return orjson.dumps(event, default=_fields)


def decode_event(data: bytes | str) -> Event:
    """Parse and validate one event; raises ``pydantic.ValidationError`` for anything else."""
    event: Event = _ADAPTER.validate_json(data)
    return event


def full_prompt_ids(event: TurnRecord, parent_ids: list[int] | None) -> list[int]:
    """The turn's whole prompt, given its parent's full ids (the parent's prompt + output).

    Raises ``ValueError`` if the parent's ids are needed and missing or too short.
    """
    if event.reused_prompt_tokens == 0:
        return list(event.prompt_ids)
    if parent_ids is None or len(parent_ids) != event.reused_prompt_tokens:
        raise ValueError(
            f"turn {event.turn_id} reuses {event.reused_prompt_tokens} ids of {event.parent_turn_id}, "
            f"got {None if parent_ids is None else len(parent_ids)}"
        )
    return [*parent_ids, *event.prompt_ids]


def event_json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of every event kind, keyed by kind (what ``docs/events/`` holds)."""
    return {t.model_fields["kind"].default: t.model_json_schema(mode="serialization") for t in EVENT_TYPES}
