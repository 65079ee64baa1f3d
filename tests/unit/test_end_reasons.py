"""End reasons and the batcher's --unfinished policy (issue 42), on built trajectories."""

from __future__ import annotations

from consumers.grouping import prepare_trajectory
from consumers.trajectories import SessionEvents, build_trajectories
from pipeline.events import SessionOpened, TurnAborted, TurnCompleted

from ..support.events import common, turn_completed


def _session(last: str) -> list[object]:
    root = turn_completed("s", 1, turn_id="t1", output_ids=[7, 8, 9])
    child = turn_completed("s", 2, turn_id="t2", parent_turn_id="t1", reused=7, prompt_ids=[5, 6], output_ids=[10, 11])
    if last == "aborted":
        fields = child.model_dump(exclude={"kind", "finish_reason"})
        end: TurnCompleted | TurnAborted = TurnAborted(**fields, reason="engine_error", detail="boom")
    else:
        end = child.model_copy(update={"finish_reason": last})
    return [SessionOpened(**common("s", 0)), root, end]


def test_a_trajectory_ends_as_its_last_turn_or_its_cut_says() -> None:
    for last in ("stop", "length", "tool_calls"):
        [trajectory] = build_trajectories(SessionEvents.of(_session(last)), emitted_because="closed")  # type: ignore[arg-type]
        assert trajectory.end_reason == last
    [aborted] = build_trajectories(SessionEvents.of(_session("aborted")), emitted_because="closed", keep_aborted=True)  # type: ignore[arg-type]
    assert (aborted.end_reason, aborted.abort_reason, aborted.aborted) == ("engine_error", "engine_error", True)
    [capped] = build_trajectories(SessionEvents.of(_session("stop")), emitted_because="cap", max_turns=1)  # type: ignore[arg-type]
    assert capped.end_reason == "max_turns" and capped.truncated
    [cut] = build_trajectories(SessionEvents.of(_session("stop")), emitted_because="closed", max_tokens=8)  # type: ignore[arg-type]
    assert cut.end_reason == "max_tokens" and cut.truncated and len(cut.token_ids) == 8


def test_the_unfinished_policy_keeps_drops_or_masks_the_last_turn() -> None:
    [unfinished] = build_trajectories(
        SessionEvents.of(_session("length")), emitted_because="closed", default_reward=1.0
    )  # type: ignore[arg-type]
    [finished] = build_trajectories(SessionEvents.of(_session("stop")), emitted_because="closed", default_reward=1.0)  # type: ignore[arg-type]
    shape = {"prompt_length": 64, "response_length": 64, "overlong": "truncate", "no_reward": "drop"}
    assert prepare_trajectory(unfinished, unfinished="keep", **shape) == unfinished  # type: ignore[arg-type]
    assert prepare_trajectory(unfinished, unfinished="drop", **shape) == "unfinished"  # type: ignore[arg-type]
    masked = prepare_trajectory(unfinished, unfinished="mask", **shape)  # type: ignore[arg-type]
    assert not isinstance(masked, str)
    last = masked.turns[-1]
    assert masked.loss_mask[last.start : last.start + last.length] == [0, 0] and not last.trained
    assert sum(masked.loss_mask) == sum(unfinished.loss_mask) - 2  # the first turn stays in the loss
    assert masked.logprobs == unfinished.logprobs  # what was sampled is still recorded
    assert prepare_trajectory(finished, unfinished="mask", **shape) == finished  # type: ignore[arg-type]


def test_the_soft_overlong_penalty_is_dapos() -> None:
    from consumers.grouping import soft_overlong_penalty

    assert [soft_overlong_penalty(n, 100, 20) for n in (50, 80, 90, 100, 150)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    [trajectory] = build_trajectories(SessionEvents.of(_session("stop")), emitted_because="closed", default_reward=1.0)  # type: ignore[arg-type]
    shape = {"prompt_length": 64, "overlong": "truncate", "no_reward": "drop"}
    response = trajectory.response_length  # 7: the first answer, the second prompt's part, the second answer
    within = prepare_trajectory(trajectory, response_length=64, overlong_penalty=8, **shape)  # type: ignore[arg-type]
    assert not isinstance(within, str) and within.reward == 1.0
    near = prepare_trajectory(trajectory, response_length=response + 2, overlong_penalty=4, **shape)  # type: ignore[arg-type]
    assert not isinstance(near, str) and near.reward == 1.0 - 0.5  # 2 tokens into a 4-token cache
    beyond = prepare_trajectory(trajectory, response_length=response - 2, overlong_penalty=4, **shape)  # type: ignore[arg-type]
    assert not isinstance(beyond, str) and beyond.reward == 0.0 and beyond.truncated  # -1, and cut


def test_a_length_finish_at_the_context_window_is_context_exhausted() -> None:
    events = _session("length")
    events[-1] = events[-1].model_copy(update={"length_cause": "context"})  # type: ignore[attr-defined]
    [trajectory] = build_trajectories(SessionEvents.of(events), emitted_because="closed")  # type: ignore[arg-type]
    assert trajectory.end_reason == "context_exhausted"
    events[-1] = events[-1].model_copy(update={"length_cause": "max_tokens"})  # type: ignore[attr-defined]
    [trajectory] = build_trajectories(SessionEvents.of(events), emitted_because="closed")  # type: ignore[arg-type]
    assert trajectory.end_reason == "length"
