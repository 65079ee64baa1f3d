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
* a mixture-of-experts model's routing is kept for replay in training (Rollout Routing Replay,
  "R3"): ``routed_experts`` (schema 4) holds, for every position of ``token_ids`` but the last,
  the experts that routed that token when it was fed to the model, ``[len(token_ids) - 1, layers,
  top_k]`` (:class:`ExpertRoutes`). It is the chain's turns' own rows (``turn.completed``'s
  ``routed_experts``, :mod:`pipeline.events`) end to end; the last token was never fed, so it
  has no row. Null: a dense model, a turn without routes in the chain, or a trajectory written
  before schema 4.
* the LoRA adapter that sampled the chain (schema 4): ``adapter``, null for the base model. Its
  turns' ``policy_versions``, and so ``min_policy_version``/``max_policy_version``, are that
  adapter's versions: each adapter numbers its own from 0, and the base has its own. The
  gateway keeps a session on the adapter of its first turn, so a chain has one; a chain that
  mixes adapters anyway (events edited or merged by hand) takes its leaf's, with a warning, and
  its min/max versions count only that adapter's tokens. A trajectory written before schema 4
  decodes with ``adapter`` null: the base.
* a vision-language model's images (schema 5): ``images``, every image of the chain's prompts in
  order (:class:`TrajectoryImage`): the SHA-256 of its bytes (``images/<sha256>`` in the image
  bucket, ``sg_images``), ``start`` (the index in ``token_ids`` of its first placeholder token),
  ``tokens`` (its run of placeholder ids), the processor's ``grid_thw``, the SHA-256 of the pixel
  values the policy consumed (``pixels_sha256``) and the processor's fingerprint
  (``processors/<fingerprint>`` in the same bucket). It is the leaf turn's ``images``
  (:class:`pipeline.events.ImageRecord`): that turn's prompt is a prefix of ``token_ids``, so its
  positions are the trajectory's. Validated on construction (:func:`pipeline.chains.images_problem`): in order,
  within ``token_ids``, each run ``tokens`` copies of one placeholder id that appears nowhere else
  (a sampled placeholder would leave the vision tower's features and the prompt's slots unequal).
  Empty: a text-only chain, or a trajectory written before schema 5.
* each turn's implicit signals (schema 6): ``turns[].signals``, what the session said about it
  (:mod:`consumers.signals`: ``accepted``, ``retried``, ``edited``, ``tool_error``, ``abandoned``),
  from every event of its session, later turns' included. Empty before schema 6.

A turn that did not extend its parent (a new root) starts a trajectory of its own; the gateway
never splices, so neither does the assembler. The trajectory id is a digest of the session id
and the chain's turn ids, so the same chain always gets the same id, and publishing it twice
(after a crash) is deduplicated by JetStream.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pipeline.chains import images_problem
from pipeline.events import ImageRecord
from pipeline.routes import decode_routes, encode_routes, routes_problem
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import numpy.typing as npt
    from pipeline.tombstones import Tombstones

__all__ = [
    "END_REASONS",
    "HEALTH_FLAGS",
    "UNFINISHED",
    "EndReason",
    "ExpertRoutes",
    "TRAJECTORY_SCHEMA_VERSION",
    "Trajectory",
    "TrajectoryImage",
    "TurnSummary",
    "erased",
    "has_logprob",
    "health_flags",
    "image_cut",
    "images_problem",
    "token_policy_versions",
    "trajectory_id",
]

# 2: per-token policy versions (turns' policy_versions); 3: thinking (reasoning_mask, turns' reasoning_tokens);
# 4: routed experts (routed_experts) and the LoRA adapter (adapter); 5: images (images); 6: turns' implicit
# signals (turns[].signals)
TRAJECTORY_SCHEMA_VERSION: Literal[6] = 6


def erased(tombstones: Tombstones, tenant: str, session_id: str) -> bool:
    """Whether the session (``tenant``: the events' tenant digest) was forgotten (:mod:`pipeline.tombstones`)."""
    from pipeline.events import subject_token

    return tombstones.forgets(subject_token(tenant), subject_token(session_id))


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


class ExpertRoutes(BaseModel):
    """The experts that routed a sequence's tokens: ``[rows, layers, top_k]`` expert ids, base64 in ``data``.

    The encoding of :class:`pipeline.events.RoutedExperts` without ``start`` (a trajectory's rows
    start at position 0): ``data`` is the standard base64 of the C-order array of ``dtype``, so
    row ``i`` is ``array()[i]``. A trajectory's routes have one row per token but the last.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[int, int, int] = Field(description="[rows, MoE layers, experts per token (top_k)]")
    dtype: Literal["uint8", "uint16"] = Field(description="the expert ids' type: uint8 up to 256 experts")
    data: str = Field(description="standard base64 of the C-order array")

    @model_validator(mode="after")
    def _data_of_the_right_size(self) -> ExpertRoutes:
        if (problem := self.problem()) is not None:
            raise ValueError(problem)
        return self

    def problem(self, tokens: int | None = None) -> str | None:
        """What is wrong with these routes (for a sequence of ``tokens`` ids, if given); ``None``: nothing.

        Checked on construction too; a copy made without validation (``model_copy``) is checked
        here by the batcher and the verl layouts.
        """
        return routes_problem(self.shape, self.dtype, self.data, tokens)

    def array(self) -> npt.NDArray[Any]:
        """The expert ids, ``[rows, layers, top_k]``, in native byte order (:func:`pipeline.routes.decode_routes`)."""
        return decode_routes({"shape": list(self.shape), "dtype": self.dtype, "data": self.data})

    @classmethod
    def of(cls, array: npt.NDArray[Any]) -> ExpertRoutes:
        """Encode a ``[rows, layers, top_k]`` array of uint8 or uint16 expert ids."""
        encoded = encode_routes(array)
        return cls(shape=tuple(encoded["shape"]), dtype=encoded["dtype"], data=encoded["data"])

    def head(self, rows: int) -> ExpertRoutes:
        """The first ``rows`` rows (all of them if there are fewer)."""
        if rows >= self.shape[0]:
            return self
        return ExpertRoutes.of(self.array()[: max(rows, 0)])


class TrajectoryImage(ImageRecord):
    """One image of a trajectory's prompts (schema 5): a turn's image record
    (:class:`pipeline.events.ImageRecord`, the one declaration of its fields), placed in ``token_ids``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int = Field(ge=0, description="index in token_ids of its first placeholder token")

    @property
    def end(self) -> int:
        """The index in ``token_ids`` just after its placeholder run."""
        return self.start + self.tokens


def image_cut(images: list[TrajectoryImage], cut: int) -> int:
    """Where to cut token ids at ``cut`` or before without splitting an image's run: before it."""
    for image in images:
        if image.start < cut < image.end:
            return image.start
    return cut


EndReason = Literal[
    "stop", "tool_calls", "length", "context_exhausted", "client_disconnected", "engine_error", "shutdown",
    "cancelled", "max_turns", "max_tokens",
]  # fmt: skip
END_REASONS: dict[str, str] = {
    "stop": "the model ended its last turn (an end-of-turn token or a stop string)",
    "tool_calls": "the last turn called tools and no turn with their results followed (the agent stopped)",
    "length": "the last turn hit the client's max_tokens: its answer is unfinished",
    "context_exhausted": "the last turn reached the end of the model's context window: its answer is unfinished",
    "client_disconnected": "the client went away while the last turn streamed (aborted)",
    "engine_error": "the engine failed during the last turn (aborted)",
    "shutdown": "the gateway shut down during the last turn (aborted)",
    "cancelled": "the last turn was cancelled (aborted)",
    "max_turns": "cut at the assembler's --max-turns: the session went on",
    "max_tokens": "cut at the assembler's --max-tokens: the chain went on",
}
"""Every end reason, and what it means (docs/trajectories.md); ``length`` and the aborted ones leave an
unfinished last turn, ``max_turns``/``max_tokens`` a cut chain (the batcher's ``--unfinished`` policy)."""

UNFINISHED = frozenset({"length", "context_exhausted", "client_disconnected", "engine_error", "shutdown", "cancelled"})
"""End reasons whose last turn is unfinished."""

HEALTH_FLAGS: dict[str, str] = {
    "no-logprobs": "a sampled token has no logprob (not finite, or the -9999 a server without logprobs leaves)",
    "truncated": "cut at the turn or token cap: the last turns are not in it",
    "aborted": "the last turn did not finish (abort_reason says why)",
    "incomplete": "an event of the session was missing when it was emitted",
    "no-reward": "no feedback and no default reward: the batcher drops it by default",
    "mixed-versions": "its sampled tokens come from more than one policy version",
    "mixed-adapters": "its turns name more than one LoRA adapter",
    "no-routes": "a mixture-of-experts chain whose routes were dropped (some turns had none, or they do not join)",
    "forked": "another trajectory of its session shares its first turns (a retry, an edit, n > 1)",
    "new-root": "its first turn re-rendered a history the gateway had recorded (a fork cause is on the turn): "
    "assistant text in its prompt was not sampled in this chain",
    "unscored": "a scorer of the batcher's --reward gave no score (timed out, failed, or not in time): its reward is "
    "the assembler's (feedback, default, or none); set by the batcher (consumers.scores), never by the assembler",
}
"""Every record-health flag a trajectory can carry, and what it means (docs/trajectories.md)."""


MISSING_LOGPROB = -9999.0
"""How a logprob the engine did not give is written (JSON has no -inf; a server that sent none: the
remote engines write this): a sampled id at or below it has no logprob."""


def has_logprob(value: float) -> bool:
    """Whether a sampled id's recorded logprob is a real one (finite, above :data:`MISSING_LOGPROB`)."""
    return math.isfinite(value) and value > MISSING_LOGPROB


def health_flags(trajectory: Trajectory, *, forked: bool, unrouted: bool, new_root: bool, adapters: int) -> list[str]:
    """The record-health flags of a built trajectory, in :data:`HEALTH_FLAGS`'s order."""
    sampled = (lp for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m)
    found = {
        "no-logprobs": any(not has_logprob(lp) for lp in sampled),
        "truncated": trajectory.truncated,
        "aborted": trajectory.aborted,
        "incomplete": not trajectory.complete,
        "no-reward": trajectory.reward is None,
        "mixed-versions": trajectory.min_policy_version != trajectory.max_policy_version,
        "mixed-adapters": adapters > 1,
        "no-routes": unrouted,
        "forked": forked,
        "new-root": new_root,
        "unscored": False,  # the batcher's to set (consumers.scores.apply_scores)
    }
    return [flag for flag in HEALTH_FLAGS if found[flag]]


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
    signals: list[str] = Field(
        default_factory=list,
        description="implicit signals on this turn (consumers.signals.SIGNALS: accepted, retried, edited, "
        "tool_error, abandoned; docs/rewards.md); empty: none, or written before schema 6",
    )
    trained: bool = Field(
        True,
        description="its sampled ids are in this trajectory's loss_mask; false: another trajectory of the "
        "session, which shares this turn, trains them (train-once, docs/trajectories.md)",
    )
    time_to_first_token_s: float | None = None
    duration_s: float = 0.0


class Trajectory(BaseModel):
    """One chain of turns, token-exact, with its rewards and provenance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2, 3, 4, 5, 6] = TRAJECTORY_SCHEMA_VERSION
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
    routed_experts: ExpertRoutes | None = Field(
        None,
        description="mixture-of-experts models: the experts that routed each token but the last, "
        "[len(token_ids) - 1, layers, top_k]; null: none recorded (a dense model, or before schema 4)",
    )
    adapter: str | None = Field(
        None,
        description="the LoRA adapter that sampled the chain, whose versions the policy versions are; "
        "null: the base model (and every trajectory written before schema 4)",
    )
    images: list[TrajectoryImage] = Field(
        default_factory=list,
        description="vision-language models: every image of the prompts, in order, placed in token_ids; "
        "empty: none (a text-only chain, or before schema 5)",
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
    abort_reason: str | None = Field(
        None, description="why the last turn did not finish (turn.aborted's reason); null: it finished"
    )
    end_reason: EndReason | None = Field(
        None,
        description="why the trajectory ends where it does (END_REASONS); null: written before end reasons",
    )
    continues_turn_id: str | None = Field(
        None,
        description="its first turn carries on the session's conversation after the client compacted its history: "
        "the turn it continues (turn.completed's continues_turn_id); group the trajectories of one conversation by it",
    )
    revision: int = Field(
        0,
        ge=0,
        description="0 as first emitted; each late reward (feedback after emission) publishes the trajectory "
        "again, same id, one higher",
    )
    health: list[str] = Field(
        default_factory=list,
        description="record-health flags (HEALTH_FLAGS, docs/trajectories.md): what makes this row doubtful; "
        "computed once by the assembler, so the console, /metrics and the command line agree",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_thinking_before_schema_3(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reasoning_mask" not in data and isinstance(data.get("token_ids"), list | tuple):
            return {**data, "reasoning_mask": [0] * len(data["token_ids"])}
        return data

    @model_validator(mode="after")
    def _one_route_per_fed_token(self) -> Trajectory:
        if self.routed_experts is not None and (problem := self.routed_experts.problem(len(self.token_ids))):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _images_on_their_placeholders(self) -> Trajectory:
        if (problem := images_problem(self.token_ids, self.images)) is not None:
            raise ValueError(problem)
        return self

    def rewarded(self, reward: float | None, source: str | None) -> Trajectory:
        """This trajectory with another reward, its ``no-reward`` health flag following it."""
        health = [f for f in self.health if f != "no-reward"]
        if reward is None:
            health = [f for f in HEALTH_FLAGS if f in health or f == "no-reward"]
        return self.model_copy(update={"reward": reward, "reward_source": source, "health": health})

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
