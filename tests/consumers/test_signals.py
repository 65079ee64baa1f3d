"""consumers.signals: implicit signals folded from a session's events onto the turns they name, and
the ``signals`` scorer's documented weights (the pipeline's side: tests/e2e/test_signals.py)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from consumers.scorers import Scorer, parse_scorer
from consumers.signals import DEFAULT_WEIGHTS, parse_weights, signals_answer, turn_signals
from pipeline.events import SignalRecord, TurnAborted

from ..support.events import turn_completed


def test_signals_are_folded_onto_the_turns_they_name() -> None:
    first = turn_completed(turn_id="a", seq=1)
    retry = turn_completed(turn_id="b", seq=2).model_copy(
        update={"signals": [SignalRecord(turn_id="a", signal="retried")]}
    )
    child = turn_completed(turn_id="c", parent_turn_id="b", seq=3).model_copy(
        update={"signals": [SignalRecord(turn_id="b", signal="tool_error", detail="call_1: Error")]}
    )
    fields = {k: v for k, v in child.model_dump().items() if k != "finish_reason"}
    gone = TurnAborted(**{**fields, "kind": "turn.aborted", "turn_id": "d", "parent_turn_id": None,
                          "seq": 4, "signals": [], "reason": "client_disconnected"})  # fmt: skip
    assert turn_signals([first, retry, child, gone]) == {
        "a": ["retried"], "b": ["accepted", "tool_error"], "c": [], "d": ["abandoned"],
    }  # fmt: skip


def _document(*turns: list[str]) -> dict[str, Any]:
    return {"turns": [{"signals": list(s)} for s in turns]}


def test_the_scorer_weighs_clamps_and_averages() -> None:
    assert dict(DEFAULT_WEIGHTS) == {"accepted": 1.0, "retried": -1.0, "edited": -0.5, "tool_error": -0.5,
                                     "abandoned": -1.0}  # fmt: skip
    answer = signals_answer(_document(["accepted", "tool_error"], ["retried", "abandoned"], []), DEFAULT_WEIGHTS)
    assert answer["turns"] == [0.5, -1.0, 0.0]  # -2 clamped to -1
    assert answer["score"] == pytest.approx(-0.5 / 3)
    assert (answer["retried"], answer["accepted"], answer["edited"]) == (1.0, 1.0, 0.0)
    heavier = parse_weights("retried=-2, accepted=0.25")
    assert heavier["retried"] == -2.0 and heavier["edited"] == -0.5
    assert signals_answer(_document(["accepted"]), heavier)["score"] == 0.25


@pytest.mark.parametrize("spec", ["s=signals:retried", "s=signals:x=1", "s=signals:retried=x", "s=signals:edited=inf"])
def test_bad_weights_are_refused_at_start(spec: str) -> None:
    with pytest.raises(ValueError, match="signals"):
        parse_scorer(spec)


def test_a_signals_scorer_scores_a_document() -> None:
    spec = parse_scorer("sig=signals:edited=-1")
    assert (spec.kind, spec.target, spec.spec, parse_scorer("s=signals").spec) == (
        "signals", "edited=-1", "signals:edited=-1", "signals"
    )  # fmt: skip
    verdict = anyio.run(Scorer.signals(spec).run, _document(["accepted"], ["edited"]))
    assert verdict.status == "scored" and verdict.value is not None
    assert (verdict.value.score, verdict.value.turns) == (0.0, [1.0, -1.0])
