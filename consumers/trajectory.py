"""Trajectories: what the assembler emits and the batcher consumes.

A trajectory is one chain of turns of a session (root to leaf of its turn tree), token-exact:

* ``token_ids`` is the whole sequence the chain's last turn saw plus what it sampled: the first
  turn's prompt, then for every turn its sampled ids, then the ids the next turn appended (tool
  results, user messages, template text), and so on;
* ``loss_mask`` is 1 exactly on sampled ids, 0 elsewhere; ``logprobs`` holds the logprob each
  sampled id was drawn with and 0.0 elsewhere (contract T1);
* ``prompt_length`` is the length of the first turn's prompt: verl's ``prompts`` are
  ``token_ids[:prompt_length]`` and its ``responses`` the rest (assistant and tool tokens
  alike, told apart by ``response_mask`` = ``loss_mask[prompt_length:]``).
* every sampled id is labelled with the policy version that sampled it: each turn's
  ``policy_versions`` spans (``[version, first index in the turn's output]``), expanded by
  :meth:`Trajectory.token_policy_versions`; ``min_policy_version`` is the oldest token's version
  (what staleness is judged by), ``max_policy_version`` the newest.
* a reasoning model's thinking is marked: ``reasoning_mask`` is 1 exactly on sampled ids that are
  thinking (``<think>``/``</think>`` included), 0 elsewhere, laid out with the ids by
  :func:`pipeline.chains.chain_tokens`; each turn's ``reasoning_tokens`` (its first output ids
  that are thinking) and ``answer_start`` (its first answer id; null when it ended inside
  thinking) say the same per turn. Thinking stays in ``loss_mask``: a trainer that wants to
  exclude or weight it does so with ``reasoning_mask``. Schema 1/2 trajectories (written before)
  decode with no thinking: zeros, and ``0``/``0`` per turn.

A turn that did not extend its parent (a new root) starts a trajectory of its own; the gateway
never splices, so neither does the assembler. The trajectory id is a digest of the session id
and the chain's turn ids, so the same chain always gets the same id, and publishing it twice
(after a crash) is deduplicated by JetStream.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TRAJECTORY_SCHEMA_VERSION", "Trajectory", "TurnSummary", "token_policy_versions", "trajectory_id"]

# 2: per-token policy versions (turns' policy_versions); 3: thinking (reasoning_mask, turns' reasoning_tokens)
TRAJECTORY_SCHEMA_VERSION: Literal[3] = 3


def trajectory_id(session_id: str, turn_ids: list[str]) -> str:
    """The deterministic id of a chain of turns."""
    digest = hashlib.sha256("\x1f".join([session_id, *turn_ids]).encode()).hexdigest()
    return f"tr{digest[:32]}"


def token_policy_versions(turns: list[TurnSummary], length: int) -> list[int]:
    """Per-position policy versions of a sequence of ``length`` ids holding ``turns`` (-1: not sampled)."""
    out = [-1] * length
    for turn in turns:
        spans = turn.policy_versions or [(turn.policy_version, 0)]
        for i, (version, first) in enumerate(spans):
            last = spans[i + 1][1] if i + 1 < len(spans) else turn.length
            start, end = turn.start + first, min(turn.start + last, length)
            out[start:end] = [version] * max(0, end - start)
    return out


class TurnSummary(BaseModel):
    """Where one turn sits in a trajectory, and what it was."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    turn_id: str
    start: int = Field(ge=0, description="index in token_ids of the turn's first sampled id")
    length: int = Field(ge=0, description="how many ids it sampled")
    finish_reason: str | None = Field(description="null: aborted")
    policy_version: int = Field(description="the version that sampled the turn's first id")
    policy_versions: list[tuple[int, int]] = Field(
        default_factory=list,
        description="[version, first index in the turn's output] spans; empty (schema 1): all policy_version",
    )
    reasoning_tokens: int = Field(
        0, ge=0, description="the first output ids that are thinking, <think> and </think> included (0: none)"
    )
    answer_start: int | None = Field(
        0,
        ge=0,
        description="index in the turn's output of its first answer id; null: it ended while thinking",
    )
    reward: float | None = Field(None, description="turn-level feedback (the latest), if any")
    time_to_first_token_s: float | None = None
    duration_s: float = 0.0


class Trajectory(BaseModel):
    """One chain of turns, token-exact, with its rewards and provenance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2, 3] = TRAJECTORY_SCHEMA_VERSION
    trajectory_id: str
    session_id: str
    tenant: str
    model: str
    agent: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict, description="the session's metadata (e.g. group)")
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reasoning_mask: list[int] = Field(
        default_factory=list,  # filled with zeros when absent (see _no_thinking_before_schema_3)
        description="1 on sampled ids that are thinking, 0 elsewhere; absent (schema 1/2, or no thinking): all 0",
    )
    prompt_length: int = Field(ge=0)
    turns: list[TurnSummary]
    num_turns: int = Field(ge=1)
    min_policy_version: int
    max_policy_version: int
    reward: float | None = Field(description="the trajectory's scalar reward; null: none (by policy)")
    reward_source: str | None = Field(None, description="'feedback', 'default', or a reward function's name")
    aborted: bool = Field(False, description="the last turn did not finish (kept by policy)")
    truncated: bool = Field(False, description="cut at the turn or length cap")
    complete: bool = Field(True, description="every event of the session was there when it was emitted")
    emitted_because: Literal["closed", "idle", "cap"]
    started_at: float
    ended_at: float

    @model_validator(mode="before")
    @classmethod
    def _no_thinking_before_schema_3(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reasoning_mask" not in data and isinstance(data.get("token_ids"), list | tuple):
            return {**data, "reasoning_mask": [0] * len(data["token_ids"])}
        return data

    def token_policy_versions(self) -> list[int]:
        """The policy version of every position of ``token_ids``: -1 where nothing was sampled."""
        return token_policy_versions(self.turns, len(self.token_ids))

    @property
    def response_length(self) -> int:
        """Ids after the first prompt."""
        return len(self.token_ids) - self.prompt_length

    def encode(self) -> bytes:
        """The wire form: compact JSON via orjson."""
        return orjson.dumps(self.model_dump(mode="python"))

    @classmethod
    def decode(cls, data: bytes | str) -> Trajectory:
        """Parse and validate."""
        return cls.model_validate_json(data)
