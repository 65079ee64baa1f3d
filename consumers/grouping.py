"""The batcher's grouping policy: which trajectories are kept, and how they make groups and batches.

:class:`GroupPlanner` is the batcher's decisions without its I/O: no NATS, no acknowledgements,
and time only through the clock it is given, so it can be driven (and tested) offline. The
batcher (:mod:`consumers.batcher`) hands it every trajectory not already bound to a batch,
acknowledges what it drops, holds what it keeps, and asks it for the next batch.

Policies, checked in this order except that a too-long *response* is judged after the reward
(:func:`prepare_trajectory` holds all but staleness):

* **staleness**: dropped when ``min_policy_version < current - max_staleness``, ``current`` being
  the newest version known *of the trajectory's adapter*: the highest ``max_policy_version`` seen
  in a trajectory of that adapter (:meth:`GroupPlanner.note_trajectory`) and the latest
  ``policy.updated`` event of it (:meth:`GroupPlanner.note_policy`). Each LoRA adapter numbers
  its versions from 0 (:attr:`~consumers.trajectory.Trajectory.adapter`), so an adapter at version
  5 makes nothing of the base's, or of another adapter's, stale;
* **malformed**: ids, mask, logprobs and reasoning mask of different lengths, a mask value other
  than 0/1, a sampled id inside the first prompt (which verl's layout would lose), thinking
  marked on an id that was not sampled, routed experts that are not one row per id but the
  last, or images off their placeholder runs: dropped, so that a batch never fails to build in
  the trainer;
* **length**: a prompt over ``prompt_length`` is dropped; a response over ``response_length`` is
  cut there (``overlong="truncate"``: ids, masks and logprobs cut, routed experts to one row
  per kept id but the last, turns clipped (their thinking too), marked ``truncated``; a cut that
  would split an image's placeholder run moves before it, and the images after go) or dropped
  (``"drop"``); an empty prompt or response is dropped (verl needs both);
* **reward**: a trajectory without one is dropped (``no_reward="drop"``) or gets 0.0 (``"zero"``);
* **images**: a trajectory whose images the batcher could not rebuild exactly
  (:mod:`consumers.images`: an object missing, or pixels that differ from those the policy saw) is
  dropped (``images``): the batcher decides that, and tells :meth:`GroupPlanner.admit`.

Groups: a trajectory's group is its :func:`group_uid` by ``group_key``; a
``metadata:<name>`` key that the session lacks falls back to the prompt. A group with a dropped
member can never be whole: when its members plus its dropped count reach ``group_size`` the rest
are released too (dropped as an incomplete group). More than ``group_size`` trajectories with one
key (a session that branched) make further groups of the same key. With ``group_timeout_s`` an
incomplete group held that long is released by :meth:`GroupPlanner.expire`; without it, it waits
forever. Whole groups go into batches in the order they completed; two groups of one key in one
batch get distinct uids (``<uid>.1``, ...).

LoRA adapters never mix: every adapter (and the base model) has its own groups, its own queue of
whole groups and its own versions, as if it had a planner of its own; a group's key is its uid
*and* its adapter, and a batch (:class:`PlannedBatch`, whose ``adapter`` it names) is made of one
adapter's groups. The next batch is that of the adapter whose oldest whole group completed first,
among those with ``batch_size`` members ready. A batcher serving one adapter
(:class:`AdapterFilter`) hands the planner only that adapter's trajectories.

The count of a group's dropped members lives here, in memory: after a restart such a group waits
for members that will not come (hence ``group_timeout_s``).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pipeline.events import subject_token

from .trajectory import UNFINISHED, Trajectory, TurnSummary, image_cut, images_problem

__all__ = [
    "AdapterFilter",
    "Admission",
    "Drop",
    "DroppedGroup",
    "GroupPlanner",
    "GroupingPolicy",
    "PlannedBatch",
    "adapter_filter",
    "check_batch_shape",
    "group_uid",
    "prepare_trajectory",
]

Drop = Literal["stale", "length", "no_reward", "malformed", "images", "unfinished"]


def check_batch_shape(batch_size: int, group_size: int) -> None:
    """Raise ``ValueError`` unless ``batch_size`` is a positive multiple of a positive ``group_size``."""
    if batch_size < 1 or group_size < 1 or batch_size % group_size:
        raise ValueError(f"batch_size {batch_size} must be a positive multiple of group_size {group_size}")


@dataclass(frozen=True, slots=True)
class AdapterFilter:
    """The one LoRA adapter whose trajectories (or batches) a consumer takes: ``adapter``, or the base model (``None``).

    Built by :func:`adapter_filter` from a consumer's ``only_adapter``/``only_base`` settings. An
    adapter may be named ``base``, so the base model is selected by a setting of its own.
    """

    adapter: str | None  # None: the base model

    def takes(self, adapter: str | None) -> bool:
        """Whether a trajectory or batch of ``adapter`` (``None``: the base model) is this consumer's."""
        return adapter == self.adapter

    def consumer_name(self, durable: str) -> str:
        """The durable consumer of a filtered consumer: ``<durable>-base`` or ``<durable>-adapter-<name>``.

        One per adapter, so that each filtered consumer sees every message and keeps its own;
        a name that is not a safe NATS token is digested (:func:`pipeline.events.subject_token`).
        """
        return f"{durable}-base" if self.adapter is None else f"{durable}-adapter-{subject_token(self.adapter)}"

    def __str__(self) -> str:
        return "the base model" if self.adapter is None else f"adapter {self.adapter!r}"


def adapter_filter(only_adapter: str | None, only_base: bool) -> AdapterFilter | None:
    """The filter of ``only_adapter=NAME`` or ``only_base=True``; ``None``: neither (every adapter is taken).

    Both at once, or an empty name, is a :class:`ValueError`.
    """
    if only_adapter is not None and only_base:
        raise ValueError("only_adapter and only_base exclude each other: a consumer takes one adapter's trajectories")
    if only_adapter is not None and not only_adapter:
        raise ValueError("only_adapter must name an adapter (only_base selects the base model)")
    if only_base:
        return AdapterFilter(None)
    return None if only_adapter is None else AdapterFilter(only_adapter)


@dataclass(frozen=True, slots=True)
class GroupingPolicy:
    """What :class:`GroupPlanner` decides by (the batcher's flags of the same names)."""

    batch_size: int = 16  # trajectories per batch
    group_size: int = 1  # a batch holds only whole groups of this size
    group_key: str = "metadata:group"  # or "prompt"
    max_staleness: int | None = None  # in policy versions; None: keep everything
    prompt_length: int = 1024
    response_length: int = 2048
    overlong: Literal["truncate", "drop"] = "truncate"
    no_reward: Literal["drop", "zero"] = "drop"
    group_timeout_s: float | None = None  # release a group still incomplete after this long
    # A trajectory whose last turn is unfinished (end reason `length`, or aborted: UNFINISHED):
    # kept as it is, dropped, or kept with that turn out of the loss (docs/batches.md).
    unfinished: Literal["keep", "drop", "mask"] = "keep"
    # DAPO's soft over-long punishment: a response longer than response_length - overlong_penalty
    # tokens loses up to 1 from its reward, linearly, all of it at response_length and beyond.
    overlong_penalty: int | None = None

    def __post_init__(self) -> None:
        check_batch_shape(self.batch_size, self.group_size)
        if self.group_key != "prompt" and not (self.group_key.startswith("metadata:") and len(self.group_key) > 9):
            raise ValueError(f"group_key {self.group_key!r}: expected 'prompt' or 'metadata:<name>'")
        if self.prompt_length < 1 or self.response_length < 1:
            raise ValueError("prompt_length and response_length must be positive")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")


def prepare_trajectory(
    trajectory: Trajectory,
    *,
    prompt_length: int,
    response_length: int,
    overlong: Literal["truncate", "drop"],
    no_reward: Literal["drop", "zero"],
    unfinished: Literal["keep", "drop", "mask"] = "keep",
    overlong_penalty: int | None = None,
) -> Trajectory | Drop:
    """The trajectory as it goes into a batch (cut, reward defaulted), or why it is dropped.

    Staleness is not decided here: it depends on the planner's view of the current policy.
    """
    if _malformed(trajectory):
        return "malformed"
    if not 0 < trajectory.prompt_length <= prompt_length or trajectory.response_length <= 0:
        return "length"
    if trajectory.reward is None:
        if no_reward == "drop":
            return "no_reward"
        trajectory = trajectory.rewarded(0.0, "default")
    if overlong_penalty and trajectory.reward is not None:
        penalty = soft_overlong_penalty(trajectory.response_length, response_length, overlong_penalty)
        if penalty:
            trajectory = trajectory.model_copy(update={"reward": trajectory.reward + penalty})
    if unfinished != "keep" and trajectory.end_reason in UNFINISHED and trajectory.turns:
        if unfinished == "drop":
            return "unfinished"
        last = trajectory.turns[-1]
        mask = list(trajectory.loss_mask)
        mask[last.start : last.start + last.length] = [0] * last.length
        turns = [*trajectory.turns[:-1], last.model_copy(update={"trained": False})]
        trajectory = trajectory.model_copy(update={"loss_mask": mask, "turns": turns})
    if trajectory.response_length > response_length:
        if overlong == "drop":
            return "length"
        cut = image_cut(trajectory.images, trajectory.prompt_length + response_length)  # never half an image
        if cut <= trajectory.prompt_length:
            return "length"
        turns = [_clip_turn(turn, cut - turn.start) for turn in trajectory.turns if turn.start < cut]
        trajectory = trajectory.model_copy(
            update={
                "token_ids": trajectory.token_ids[:cut],
                "loss_mask": trajectory.loss_mask[:cut],
                "logprobs": trajectory.logprobs[:cut],
                "reasoning_mask": trajectory.reasoning_mask[:cut],
                "routed_experts": routes.head(cut - 1) if (routes := trajectory.routed_experts) is not None else None,
                "images": [image for image in trajectory.images if image.end <= cut],
                "turns": turns,
                "num_turns": max(1, len(turns)) if trajectory.turns else trajectory.num_turns,
                "truncated": True,
            }
        )
    return trajectory


def soft_overlong_penalty(length: int, maximum: int, cache: int) -> float:
    """DAPO's soft over-long punishment of a response ``length`` tokens long: 0 up to ``maximum -
    cache``, then linearly down to -1 at ``maximum``, and -1 beyond."""
    start = maximum - cache
    if length <= start:
        return 0.0
    return max(-1.0, (start - length) / cache)


def _malformed(trajectory: Trajectory) -> bool:
    """Whether the trajectory's per-token fields disagree (the ``malformed`` drop; see the module docstring)."""
    ids, mask, reasoning = trajectory.token_ids, trajectory.loss_mask, trajectory.reasoning_mask
    return (
        not len(ids) == len(mask) == len(trajectory.logprobs) == len(reasoning)
        or any(m not in (0, 1) for m in mask)
        or any(mask[: trajectory.prompt_length])
        or any(r not in (0, 1) or (r and not m) for r, m in zip(reasoning, mask, strict=True))
        or (trajectory.routed_experts is not None and trajectory.routed_experts.problem(len(ids)) is not None)
        or images_problem(ids, trajectory.images) is not None
    )


def _clip_turn(turn: TurnSummary, kept: int) -> TurnSummary:
    """``turn`` with only its first ``kept`` sampled ids: a turn cut inside its thinking has no answer."""
    if kept >= turn.length:
        return turn
    thinking = min(turn.reasoning_tokens, kept)
    answer_start = None if thinking == kept else turn.answer_start
    return turn.model_copy(update={"length": kept, "reasoning_tokens": thinking, "answer_start": answer_start})


@dataclass(frozen=True, slots=True)
class DroppedGroup:
    """A group that can never be whole (a dropped member, or too old): its held members go too."""

    uid: str
    members: tuple[str, ...]  # trajectory ids held until now, to be acknowledged and forgotten
    adapter: str | None = None  # the LoRA adapter of its members; None: the base model


@dataclass(frozen=True, slots=True)
class Admission:
    """What :meth:`GroupPlanner.admit` decided about one trajectory."""

    outcome: Trajectory | Drop  # as it goes into a batch (to be held), or why it was dropped
    released: DroppedGroup | None = None  # its group, if that can no longer be whole


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """The members of the next batch and their uids, in row order: whole groups, one after another.

    Every member is of ``adapter`` (``None``: the base model): batches never mix adapters.
    """

    members: tuple[str, ...]
    uids: tuple[str, ...]
    adapter: str | None = None


@dataclass(slots=True)
class _OpenGroup:
    uid: str
    since: float
    members: list[str] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)  # a set: a second copy of a dropped one counts once


@dataclass(slots=True)
class _Lane:
    """One adapter's (or the base model's) groups and versions: adapters never share a group or a batch."""

    open: dict[str, _OpenGroup] = field(default_factory=dict)  # group uid -> its current (incomplete) instance
    ready: deque[tuple[int, str, list[str]]] = field(default_factory=deque)  # (completion number, uid, members)
    policy_version: int | None = None  # from policy.updated events (the base model's)
    seen_version: int | None = None  # from trajectories

    @property
    def current_version(self) -> int | None:
        known = [v for v in (self.policy_version, self.seen_version) if v is not None]
        return max(known) if known else None

    @property
    def ready_members(self) -> int:
        return sum(len(members) for _, _, members in self.ready)


class GroupPlanner:
    """The batcher's grouping policy as a state machine without I/O (see the module docstring)."""

    def __init__(self, policy: GroupingPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._clock = clock
        self._lanes: dict[str | None, _Lane] = {}  # adapter (None: the base model) -> its groups and versions
        self._completed = itertools.count()  # orders whole groups across adapters

    @property
    def policy(self) -> GroupingPolicy:
        """What the planner decides by."""
        return self._policy

    @property
    def open_groups(self) -> int:
        """Groups whose members are still arriving (of every adapter)."""
        return sum(len(lane.open) for lane in self._lanes.values())

    @property
    def current_version(self) -> int | None:
        """The newest policy version known of the base model; ``None``: none yet (see :meth:`version_of`)."""
        return self.version_of(None)

    def version_of(self, adapter: str | None) -> int | None:
        """The newest version known of ``adapter`` (``None``: the base model), what its staleness is measured from."""
        lane = self._lanes.get(adapter)
        return None if lane is None else lane.current_version

    def versions(self) -> dict[str | None, int]:
        """The newest version known of every adapter seen (``None``: the base model)."""
        return {a: v for a, lane in self._lanes.items() if (v := lane.current_version) is not None}

    def note_policy(self, version: int, adapter: str | None = None) -> None:
        """A ``policy.updated`` event announced ``version`` of ``adapter`` (``None``: the base model)."""
        lane = self._lane(adapter)
        lane.policy_version = max(lane.policy_version or 0, version)

    def note_trajectory(self, trajectory: Trajectory) -> None:
        """A trajectory arrived (bound to a batch or not): its newest version counts as known for its adapter."""
        lane = self._lane(trajectory.adapter)
        version = trajectory.max_policy_version
        lane.seen_version = version if lane.seen_version is None else max(lane.seen_version, version)

    def admit(self, trajectory: Trajectory, refused: Drop | None = None) -> Admission:
        """Decide one trajectory that is not bound to a batch: drop it, or hold it in its adapter's group.

        ``refused``: the caller's own reason to drop it (the batcher's image check), after staleness.
        """
        policy = self._policy
        lane = self._lane(trajectory.adapter)
        outcome: Trajectory | Drop
        current = lane.current_version
        if policy.max_staleness is not None and current is not None:
            stale = trajectory.min_policy_version < current - policy.max_staleness
        else:
            stale = False
        if stale:
            outcome = "stale"
        elif refused is not None:
            outcome = refused
        else:
            outcome = prepare_trajectory(
                trajectory,
                prompt_length=policy.prompt_length,
                response_length=policy.response_length,
                overlong=policy.overlong,
                no_reward=policy.no_reward,
                unfinished=policy.unfinished,
                overlong_penalty=policy.overlong_penalty,
            )
        uid = group_uid(trajectory, policy.group_key)
        group = lane.open.get(uid)
        if group is None:
            group = lane.open[uid] = _OpenGroup(uid, since=self._clock())
        if isinstance(outcome, str):
            group.dropped.add(trajectory.trajectory_id)
        else:
            group.members.append(trajectory.trajectory_id)
        released = None
        if len(group.members) + len(group.dropped) >= policy.group_size:
            del lane.open[uid]
            if group.dropped:
                released = DroppedGroup(uid, tuple(group.members), trajectory.adapter)
            else:
                lane.ready.append((next(self._completed), uid, group.members))
        return Admission(outcome, released)

    def expire(self) -> list[DroppedGroup]:
        """Release the groups still incomplete after ``group_timeout_s`` (none without one)."""
        timeout = self._policy.group_timeout_s
        if timeout is None:
            return []
        cutoff = self._clock() - timeout
        released = []
        for adapter, lane in self._lanes.items():
            for uid in [uid for uid, group in lane.open.items() if group.since < cutoff]:
                released.append(DroppedGroup(uid, tuple(lane.open.pop(uid).members), adapter))
        return released

    def drop(self, trajectory_ids: set[str]) -> list[DroppedGroup]:
        """Release every group, incomplete or whole, holding one of ``trajectory_ids`` (their data
        was erased): a batch is whole groups, so the group goes with them."""
        released = []
        for adapter, lane in self._lanes.items():
            for uid in [uid for uid, group in lane.open.items() if trajectory_ids.intersection(group.members)]:
                released.append(DroppedGroup(uid, tuple(lane.open.pop(uid).members), adapter))
            for ready in [r for r in lane.ready if trajectory_ids.intersection(r[2])]:
                lane.ready.remove(ready)
                released.append(DroppedGroup(ready[1], tuple(ready[2]), adapter))
        return released

    def next_batch(self, partial: bool = False) -> PlannedBatch | None:
        """The next ``batch_size`` members from one adapter's whole groups, oldest first; ``None``: not enough yet.

        Of the adapters with enough members ready, the one whose oldest whole group completed first.
        ``partial`` (a flush on demand): fewer will do, as long as one whole group is ready.
        """
        batch_size = self._policy.batch_size
        enough = 1 if partial else batch_size
        full = [(lane.ready[0][0], a) for a, lane in self._lanes.items() if lane.ready and lane.ready_members >= enough]
        if not full:
            return None
        _, adapter = min(full, key=lambda item: item[0])
        lane = self._lanes[adapter]
        uids: list[str] = []
        members: list[str] = []
        occurrences: dict[str, int] = {}
        while len(members) < batch_size and lane.ready:
            _, uid, group = lane.ready.popleft()
            seen = occurrences.get(uid, 0)
            occurrences[uid] = seen + 1
            uids += [uid if not seen else f"{uid}.{seen}"] * len(group)
            members += group
        return PlannedBatch(tuple(members), tuple(uids), adapter)

    def _lane(self, adapter: str | None) -> _Lane:
        lane = self._lanes.get(adapter)
        if lane is None:
            lane = self._lanes[adapter] = _Lane()
        return lane


def group_uid(trajectory: Trajectory, key: str) -> str:
    """The GRPO group a trajectory belongs to, by ``key`` (the one definition: the batcher's and
    every caller's; no torch needed).

    A group never spans tenants: a label is its tenant's name, as a session id is. ``"metadata:<name>"``:
    ``<tenant>/<label>`` for the session's ``metadata[name]`` (``tenant``: the events' digest, never a
    key), or, for a session without it, the prompt's group; ``"prompt"``: the sha256 of the tenant and
    the first prompt's token ids (``token_ids[:prompt_length]``), so a tenant's trajectories that
    started from the same tokens share a group and two tenants' never do (one tenant's rewards never
    move another's advantages; erasing one tenant's data never changes another's rows). Any other key
    is a :class:`ValueError`.
    """
    if key.startswith("metadata:") and len(key) > len("metadata:"):
        value = trajectory.metadata.get(key.removeprefix("metadata:"))
        if value is not None:
            return f"{trajectory.tenant}/{value}"
        key = "prompt"
    if key == "prompt":
        prompt = trajectory.token_ids[: trajectory.prompt_length]
        return hashlib.sha256(f"{trajectory.tenant}\n{','.join(map(str, prompt))}".encode()).hexdigest()
    raise ValueError(f"unknown group key {key!r}: expected 'prompt' or 'metadata:<name>'")
