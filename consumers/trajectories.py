"""Building trajectories from one session's events: a pure function, order- and duplicate-blind.

:func:`build_trajectories` takes whatever events of a session arrived (any order, any number
of copies) and returns the same trajectories for the same set of events: events are keyed by
``seq``, turns by id, and output is sorted. Each trajectory is a root-to-leaf chain of the turn
tree the events describe, its ids, loss mask, logprobs and reasoning mask laid out by
:func:`pipeline.chains.chain_tokens` (in its ``appended`` form: turn events carry only what each
turn appended to its parent's ids). A turn whose parent is missing (a session emitted
incomplete), or whose reference to its parent's ids does not add up, cannot be rebuilt exactly:
it is left out, with its descendants, and logged. (Events from this gateway never splice, so this only happens
when events were lost or cut by the stream's retention.)

A mixture-of-experts chain's routes (:attr:`Trajectory.routed_experts`) are its turns' own rows
(each ``turn.completed``'s ``routed_experts``) end to end: each turn's ``start`` must be the rows
so far, and the whole must be one row per token but the last. A chain where some turns carry
routes and others do not, or whose rows do not join up, gets none: it is logged and reported
through ``on_unrouted``, never raised (the ids and masks are still exact). A chain with no
routes at all (a dense model, events before schema 4) gets none silently.

A chain's LoRA adapter (:attr:`Trajectory.adapter`, null: the base model) is its turns'
``adapter``. The gateway keeps a session on its first turn's adapter, so a chain has one; one
whose turns name several anyway takes its leaf's, logged as a warning, and its
``min_policy_version``/``max_policy_version`` count only the tokens that adapter sampled (the
others' versions are another sequence's numbers).

A vision-language chain's images (:attr:`Trajectory.images`) are its leaf turn's ``images``: the
leaf's prompt is a prefix of the chain's ids, so their positions carry over. Each earlier turn's
``images`` must be the leaf's that lie in that turn's prompt, and the runs must be placeholder runs
(:func:`pipeline.chains.images_problem`). A chain where they are not cannot be trained on (the
vision tower's features would not fill the prompt's image slots): it is left out, logged and
reported through ``on_refused_images``, like a turn that cannot be rebuilt; never emitted without
its images. ``max_tokens`` never cuts an image in two: the cut moves before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pipeline.chains import chain_images as pipeline_chain_images
from pipeline.chains import chain_tokens
from pipeline.events import Event, FeedbackRecorded, SessionOpened, TurnAborted, TurnCompleted, TurnRecord
from pipeline.routes import chain_routes_rows

from .errors import ImagesRefused
from .signals import turn_signals
from .trajectory import (
    EndReason,
    ExpertRoutes,
    Trajectory,
    TrajectoryImage,
    TurnSummary,
    health_flags,
    image_cut,
    token_policy_versions,
    trajectory_id,
)

if TYPE_CHECKING:
    pass

__all__ = ["SessionEvents", "build_trajectories", "chain_images", "chain_routes", "train_once"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionEvents:
    """One session's durable events, deduplicated by ``seq`` and sorted."""

    events: tuple[Event, ...]

    @classmethod
    def of(cls, events: Iterable[Event]) -> SessionEvents:
        by_seq: dict[int, Event] = {}
        for event in events:
            by_seq.setdefault(event.seq, event)
        return cls(tuple(by_seq[s] for s in sorted(by_seq)))

    @property
    def session_feedback(self) -> list[FeedbackRecorded]:
        return [e for e in self.events if isinstance(e, FeedbackRecorded) and e.turn_id is None]


def build_trajectories(
    session: SessionEvents,
    *,
    emitted_because: Literal["closed", "idle", "cap"],
    complete: bool = True,
    keep_aborted: bool = False,
    max_turns: int | None = None,
    max_tokens: int | None = None,
    default_reward: float | None = None,
    shared_turns: Literal["once", "every"] = "once",
    on_unrouted: Callable[[str], None] | None = None,
    on_refused_images: Callable[[str], None] | None = None,
) -> list[Trajectory]:
    """Every chain of the session's turn tree as a trajectory (see the module docstring).

    ``on_unrouted(reason)`` is called for each chain whose routes were dropped (partial or not
    joining up), ``on_refused_images(reason)`` for each chain left out because its images do not
    line up: the assembler counts them.
    """
    events = session.events
    opened = next((e for e in events if isinstance(e, SessionOpened)), None)
    records = [e for e in events if isinstance(e, TurnRecord) and (keep_aborted or e.kind == "turn.completed")]
    records.sort(key=lambda r: (r.started_at, r.seq))
    capped = max_turns is not None and len(records) > max_turns
    if max_turns is not None:
        records = records[:max_turns]
    if not records:
        return []
    turn_rewards = {e.turn_id: e.score for e in events if isinstance(e, FeedbackRecorded) and e.turn_id is not None}
    signals = turn_signals(events)  # every turn event's, aborted ones included: they name earlier turns
    session_rewards = session.session_feedback
    reward = session_rewards[-1].score if session_rewards else default_reward
    reward_source = "feedback" if session_rewards else ("default" if default_reward is not None else None)

    turns = {r.turn_id: r for r in records}
    full: dict[str, list[int]] = {}  # turn id -> its whole prompt + its output
    parent_of: dict[str, str | None] = {}
    for record in records:  # parents start before their children, so they come first
        parent = record.parent_turn_id
        if parent is not None and (parent not in full or len(full[parent]) != record.reused_prompt_tokens):
            log.warning(
                "session %s: turn %s cannot be rebuilt (parent %s missing)", record.session_id, record.turn_id, parent
            )
            continue
        prompt = [*full[parent], *record.prompt_ids] if parent is not None else list(record.prompt_ids)
        parent_of[record.turn_id] = parent
        full[record.turn_id] = [*prompt, *record.output_ids]
    has_child = {p for p in parent_of.values() if p is not None}
    leaves = [t for t in parent_of if t not in has_child]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while (up := parent_of[path[-1]]) is not None:
            path.append(up)
        paths.append(path[::-1])
    in_chains: dict[str, int] = {}  # turn id -> how many chains hold it (a fork: more than one)
    for path in paths:
        for turn_id in path:
            in_chains[turn_id] = in_chains.get(turn_id, 0) + 1
    trajectories = []
    for path in paths:
        chain = [turns[t] for t in path]
        try:
            trajectory = _trajectory(
                chain,
                opened,
                turn_rewards,
                signals,
                reward,
                reward_source,
                emitted_because,
                complete,
                capped,
                max_tokens,
                on_unrouted,
                forked=any(in_chains[t] > 1 for t in path),
            )
        except ImagesRefused as exc:
            log.warning(
                "session %s: chain ending in turn %s left out, its images do not line up: %s",
                chain[-1].session_id,
                path[-1],
                exc.reason,
            )
            if on_refused_images is not None:
                on_refused_images(exc.reason)
            continue
        trajectories.append(trajectory)
    trajectories.sort(key=lambda t: (t.started_at, t.trajectory_id))
    if shared_turns == "once":
        trajectories = train_once(trajectories)
    return trajectories


def train_once(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Each sampled turn in the loss of exactly one trajectory: the first (in the given order) that
    holds it; the others keep its ids and logprobs with ``loss_mask`` 0 there and the turn marked
    ``trained=False``. A leaf turn belongs to one chain only, so every trajectory keeps its own."""
    owner: dict[str, str] = {}
    out = []
    for trajectory in trajectories:
        shared = [s for s in trajectory.turns if owner.setdefault(s.turn_id, trajectory.trajectory_id)
                  != trajectory.trajectory_id]  # fmt: skip
        if not shared:
            out.append(trajectory)
            continue
        mask = list(trajectory.loss_mask)
        for summary in shared:
            mask[summary.start : summary.start + summary.length] = [0] * summary.length
        ids = {s.turn_id for s in shared}
        turns = [s.model_copy(update={"trained": False}) if s.turn_id in ids else s for s in trajectory.turns]
        out.append(trajectory.model_copy(update={"loss_mask": mask, "turns": turns}))
    return out


def _trajectory(
    chain: list[TurnRecord],
    opened: SessionOpened | None,
    turn_rewards: dict[str, float],
    signals: dict[str, list[str]],
    reward: float | None,
    reward_source: str | None,
    emitted_because: Literal["closed", "idle", "cap"],
    complete: bool,
    capped: bool,
    max_tokens: int | None,
    on_unrouted: Callable[[str], None] | None,
    *,
    forked: bool,
) -> Trajectory:
    root = chain[0]
    laid_out = chain_tokens(chain, prompts="appended")  # events carry what each turn appended
    tokens, mask, logprobs = list(laid_out.token_ids), list(laid_out.loss_mask), list(laid_out.logprobs)
    reasoning = list(laid_out.reasoning_mask)
    prompt_length = laid_out.prompt_length
    routes: ExpertRoutes | None = None
    unrouted = False
    try:
        routes = chain_routes(chain, len(tokens))
    except ValueError as exc:
        unrouted = True
        log.warning("session %s: chain ending in turn %s has no routes: %s", root.session_id, chain[-1].turn_id, exc)
        if on_unrouted is not None:
            on_unrouted(str(exc))
    try:
        images = chain_images(chain, tokens)
    except ValueError as exc:
        raise ImagesRefused(chain[-1].turn_id, str(exc), missing=False) from exc
    summaries = [
        TurnSummary(
            turn_id=turn.turn_id,
            start=start,
            length=len(turn.output_ids),
            finish_reason=getattr(turn, "finish_reason", None),
            policy_version=turn.policy_version,
            policy_versions=list(turn.policy_versions),
            reasoning_tokens=turn.reasoning_tokens,
            answer_start=turn.answer_start,
            reward=turn_rewards.get(turn.turn_id),
            signals=signals.get(turn.turn_id, []),
            trained=True,
            time_to_first_token_s=turn.time_to_first_token_s,
            duration_s=turn.duration_s,
        )
        for turn, start in zip(chain, laid_out.output_starts, strict=True)
    ]
    truncated = capped
    end_reason = _end_reason(leaf := chain[-1])
    if capped:
        end_reason = "max_turns"
    if max_tokens is not None and len(tokens) > max_tokens:
        end_reason = "max_tokens"
        cut = image_cut(images, max_tokens)  # never half an image
        tokens, mask, logprobs = tokens[:cut], mask[:cut], logprobs[:cut]
        reasoning = reasoning[:cut]
        routes = routes.head(cut - 1) if routes is not None else None
        summaries = [s for s in summaries if s.start < cut]
        images = [image for image in images if image.end <= cut]
        truncated = True
    adapter = _chain_adapter(chain)
    # Every kept token's version counts: a turn that spans a weight update holds several. Only
    # the chain's adapter's turns count: another adapter's versions are another sequence.
    own = [turn for turn in chain if turn.adapter == adapter]
    counted = [s for s in summaries if s.turn_id in {turn.turn_id for turn in own}]
    versions = [v for v in token_policy_versions(counted, len(tokens)) if v >= 0] or [own[0].policy_version]
    trajectory = Trajectory(
        trajectory_id=trajectory_id(root.session_id or "", list(laid_out.turn_ids)),
        session_id=root.session_id or "",
        tenant=root.tenant,
        model=root.model,
        agent=opened.agent if opened is not None else None,
        metadata=dict(opened.metadata) if opened is not None else {},
        token_ids=tokens,
        loss_mask=mask,
        logprobs=logprobs,
        reasoning_mask=reasoning,
        routed_experts=routes,
        adapter=adapter,
        images=images,
        prompt_length=prompt_length,
        turns=summaries,
        num_turns=len(summaries),
        min_policy_version=min(versions),
        max_policy_version=max(versions),
        reward=reward,
        reward_source=reward_source,
        aborted=isinstance(leaf, TurnAborted),
        abort_reason=leaf.reason if isinstance(leaf, TurnAborted) else None,
        revision=0,
        continues_turn_id=root.continues_turn_id,
        end_reason=end_reason,
        truncated=truncated,
        complete=complete,
        emitted_because=emitted_because,
        started_at=root.started_at,
        ended_at=leaf.started_at + leaf.duration_s,
    )
    health = health_flags(
        trajectory,
        forked=forked,
        unrouted=unrouted,
        new_root=root.predecessor_turn_id is not None or root.fallback_reason is not None,
        adapters=len({turn.adapter for turn in chain}),
    )
    return trajectory.model_copy(update={"health": health})


def _end_reason(turn: TurnRecord) -> EndReason:
    """The chain's end as its last turn says it: its finish reason, or why it was aborted."""
    if isinstance(turn, TurnAborted):
        return turn.reason
    assert isinstance(turn, TurnCompleted)
    if turn.finish_reason == "length" and turn.length_cause == "context":
        return "context_exhausted"
    return turn.finish_reason


def chain_images(chain: list[TurnRecord], token_ids: list[int]) -> list[TrajectoryImage]:
    """The images of a chain whose ids are ``token_ids``, placed in them
    (:func:`pipeline.chains.chain_images` checks them; a :class:`ValueError` says why not)."""
    return [TrajectoryImage(**record.model_dump()) for record in pipeline_chain_images(chain, token_ids)]


def _chain_adapter(chain: list[TurnRecord]) -> str | None:
    """The chain's LoRA adapter (``None``: the base): its leaf's, with a warning if the turns disagree."""
    leaf = chain[-1]
    others = {_adapter_name(turn.adapter) for turn in chain if turn.adapter != leaf.adapter}
    if others:
        log.warning(
            "session %s: chain ending in turn %s mixes LoRA adapters (%s besides %s): it takes the leaf's",
            leaf.session_id,
            leaf.turn_id,
            ", ".join(sorted(others)),
            _adapter_name(leaf.adapter),
        )
    return leaf.adapter


def _adapter_name(adapter: str | None) -> str:
    return "the base model" if adapter is None else f"adapter {adapter!r}"


def chain_routes(chain: list[TurnRecord], length: int) -> ExpertRoutes | None:
    """The routes of a chain of ``length`` ids from its turns' own rows; ``None``: no turn has any.
    A :class:`ValueError` says why routes that exist cannot make the chain's
    (:func:`pipeline.routes.chain_routes_rows`, the one chaining rule)."""
    turns = [
        (turn.turn_id, r.start, ExpertRoutes(shape=r.shape, dtype=r.dtype, data=r.data).array())
        if (r := turn.routed_experts) is not None
        else (turn.turn_id, 0, None)
        for turn in chain
    ]
    rows = chain_routes_rows(turns, length)
    return ExpertRoutes.of(rows) if rows is not None else None
