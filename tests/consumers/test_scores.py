"""Scores without NATS: the reward formula and its rules, the scorers' answers and limits (a real
subprocess for ``command:``), the judge's score rule, the documents scorers read, and the flags of
``reward``, ``batch`` and ``up`` that configure them."""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from consumers.batcher import BatcherConfig
from consumers.cli import add_batch_flags, add_scorer_flags, reward_worker_config
from consumers.judge import DEFAULT_TEMPLATE, JudgeScorer, judge_score, load_template
from consumers.scorers import Scorer, ScoreValue, parse_scorer, score_value, scoring_document
from consumers.scores import RewardFormula, ScoreRecord, apply_scores
from consumers.streams import ConsumerStreams
from consumers.trajectory import Trajectory
from pipeline.connection import NatsAuth

from ..support.trajectories import make_trajectory
from .test_batcher import wait_until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "support" / "scorers.py"


def _record(t: Trajectory, scorer: str, score: float | None, status: str = "scored", **more: Any) -> ScoreRecord:
    return ScoreRecord.model_validate({
        "trajectory_id": t.trajectory_id, "session_id": t.session_id, "tenant": t.tenant, "scorer": scorer,
        "kind": "python", "status": status, "score": score, "attempts": 1, "duration_s": 0.0, "worker": "w",
        "at": 0.0, **more,
    })  # fmt: skip


# -- the formula ---------------------------------------------------------------------------------


def test_a_formula_is_a_weighted_sum_of_scorers_and_their_parts() -> None:
    formula = RewardFormula.parse(" 0.7*judge + 0.3 * tests.passed - .5*length ")
    assert formula.text == "0.7*judge+0.3*tests.passed-.5*length"
    assert formula.scorers == {"judge", "tests", "length"}
    t = make_trajectory(random.Random(0))
    records = {"judge": _record(t, "judge", 1.0), "tests": _record(t, "tests", None, parts={"passed": 0.5}),
               "length": _record(t, "length", 0.2)}  # fmt: skip
    assert formula.combine(records) == pytest.approx(0.7 + 0.15 - 0.1)
    assert formula.combine({k: v for k, v in records.items() if k != "judge"}) is None  # a term missing: none
    timed_out = records | {"judge": _record(t, "judge", None, status="timeout", error="late")}
    assert formula.combine(timed_out) is None
    assert RewardFormula.parse("judge").text == "judge"
    for wrong in ("", "judge tests", "0.7*", "2*3", "judge+", "a-b-", "judge*0.5", "$x"):
        with pytest.raises(ValueError, match="--reward"):
            RewardFormula.parse(wrong)


def test_applying_scores_follows_the_documented_rules() -> None:
    """Every term scored: the formula, named; a term missing: the assembler's reward, flagged
    ``unscored``; feedback wins; per turn, the formula over per-turn scores, a user's turn rating kept."""
    rng = random.Random(1)
    formula = RewardFormula.parse("0.5*a+0.5*b")
    plain = make_trajectory(rng).rewarded(0.0, "default")
    first, second = (turn.turn_id for turn in plain.turns)
    a = _record(plain, "a", 1.0, turns={first: 1.0, second: 0.0})
    b = _record(plain, "b", 0.0, turns={first: 1.0})
    scored = apply_scores(plain, {"a": a, "b": b}, formula)
    assert (scored.reward, scored.reward_source, "unscored" in scored.health) == (0.5, "0.5*a+0.5*b", False)
    assert [turn.reward for turn in scored.turns] == [1.0, None]  # b has no score for the second turn
    assert apply_scores(scored, {"a": a, "b": b}, formula) == scored  # again: the same

    missing = apply_scores(plain, {"a": a}, formula)
    assert (missing.reward, missing.reward_source, missing.health) == (0.0, "default", ["unscored"])
    assert apply_scores(missing, {"a": a, "b": b}, formula) == scored  # the score that came clears the flag

    none = apply_scores(make_trajectory(rng, reward=None).rewarded(None, None), {}, formula)
    assert none.reward is None and none.health == ["no-reward", "unscored"]

    rated = make_trajectory(rng)  # reward 1.0 from feedback; its first turn rated by a user too
    rated = rated.model_copy(update={"turns": [rated.turns[0].model_copy(update={"reward": -1.0}), rated.turns[1]]})
    records = {"a": _record(rated, "a", 0.0, turns={t.turn_id: 0.0 for t in rated.turns}),
               "b": _record(rated, "b", 0.0, turns={t.turn_id: 0.0 for t in rated.turns})}  # fmt: skip
    kept = apply_scores(rated, records, formula)
    assert (kept.reward, kept.reward_source, [turn.reward for turn in kept.turns]) == (1.0, "feedback", [-1.0, 0.0])


def test_batcher_config_checks_its_formula_and_what_it_awaits() -> None:
    assert BatcherConfig(reward="0.5*a+0.5*b", await_scorers=(("a", 3.0),)).formula is not None
    with pytest.raises(ValueError, match="--reward"):
        BatcherConfig(reward="0.5*")
    with pytest.raises(ValueError, match="await only scorers --reward names"):
        BatcherConfig(reward="a", await_scorers=(("b", 3.0),))
    with pytest.raises(ValueError, match="await only"):
        BatcherConfig(await_scorers=(("b", 3.0),))


# -- scorers -------------------------------------------------------------------------------------


def test_answers_become_scores_parts_and_per_turn_scores() -> None:
    assert score_value(0.5, 2) == ScoreValue(0.5)
    assert score_value(True, 2) == ScoreValue(1.0)
    assert score_value({"score": 1, "turns": [0.5, None], "passed": 3, "why": "text"}, 2) == ScoreValue(
        1.0, {"passed": 3.0}, [0.5, None]
    )
    assert score_value({"passed": 2}, 2) == ScoreValue(None, {"passed": 2.0})
    for wrong, match in ((None, "no score"), ({"why": "x"}, "no score"), (float("nan"), "finite"),
                         ({"score": 1, "turns": [1]}, "one per turn"), ("0.5", "finite")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            score_value(wrong, 2)


def test_scorer_specs_are_checked_when_given() -> None:
    spec = parse_scorer("tests=command:python verify.py --case 'a b'")
    assert (spec.name, spec.kind, spec.target) == ("tests", "command", "python verify.py --case 'a b'")
    assert parse_scorer("j=judge:http://h:1/v1#m").spec == "judge:http://h:1/v1#m"
    for wrong in ("nameless", "1x=python:m:f", "a-b=python:m:f", "x=python:m", "x=shell:ls", "x=command:",
                  "x=judge:http://h/v1", "x=judge:nourl#m"):  # fmt: skip
        with pytest.raises(ValueError, match="--scorer"):
            parse_scorer(wrong)


def _document(rng: random.Random) -> dict[str, Any]:
    return make_trajectory(rng).model_dump()


@pytest.mark.anyio
async def test_python_scorers_plain_and_async_and_their_time_limit() -> None:
    document = _document(random.Random(2))
    for function in ("length", "async_length"):
        verdict = await Scorer.python(parse_scorer(f"f=python:tests.support.scorers:{function}")).run(document)
        assert (verdict.status, verdict.attempts, verdict.value and verdict.value.score) == (
            "scored", 1, len(document["token_ids"]) / 100,
        )  # fmt: skip
    slow = parse_scorer("f=python:tests.support.scorers:slow_length")
    scorer = Scorer.python(replace(slow, timeout_s=0.01, retries=1))
    started = time.monotonic()
    verdict = await scorer.run(document)
    assert (verdict.status, verdict.attempts, verdict.error) == ("timeout", 2, "no answer within 0.01 s")
    assert time.monotonic() - started < 2
    with pytest.raises(ValueError, match="no callable"):
        Scorer.python(parse_scorer("f=python:tests.support.scorers:nothing"))


@pytest.mark.anyio
async def test_a_command_verifier_reads_stdin_and_its_failures_and_hangs_are_recorded(tmp_path: Path) -> None:
    from ..support.scorers import verified

    document = _document(random.Random(3))
    ok = await Scorer.command(parse_scorer(f"t=command:{sys.executable} {SCRIPT}")).run(document)
    assert ok.status == "scored" and ok.value == ScoreValue(verified(document), {"checked": 16.0})
    failing = parse_scorer(f"t=command:{sys.executable} {SCRIPT} --fail")
    failed = await Scorer.command(replace(failing, retries=0)).run(document)
    assert failed.status == "error" and "exited with 1: the tests failed to build" in (failed.error or "")

    pids = tmp_path / "pids"
    hanging = parse_scorer(f"t=command:{sys.executable} {SCRIPT} --hang {pids}")
    hung = await Scorer.command(replace(hanging, timeout_s=3.0, retries=0)).run(document)
    assert hung.status == "timeout"
    with anyio.fail_after(10):  # the command and the process it started are both gone
        await wait_until(lambda: not any(_alive(int(pid)) for pid in pids.read_text().split()))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_judge_score_rule() -> None:
    """JSON (fenced or not) as any answer; otherwise the first number after the last word "score"."""
    assert judge_score('{"score": 0.8}', 1).score == 0.8
    assert judge_score('```json\n{"score": 0.4, "turns": [1]}\n```', 1) == ScoreValue(
        0.4, {}, [1.0], '```json\n{"score": 0.4, "turns": [1]}\n```'
    )
    assert judge_score("0.3", 1).score == 0.3
    assert judge_score("Helpful. Score: 7/10", 1).score == 7.0
    assert judge_score("First score 0.2; on reflection the final SCORE is -0.5.", 1).score == -0.5
    answer = judge_score("scores aside, " + "x" * 5000 + " score=1", 1)
    assert answer.score == 1.0 and len(answer.answer or "") == 4000
    for wrong in ("no number", "3 out of 4", "score: none"):
        with pytest.raises(ValueError, match="no score"):
            judge_score(wrong, 1)


def test_judge_templates_name_only_known_fields(tmp_path: Path) -> None:
    assert load_template(None) == DEFAULT_TEMPLATE
    (tmp_path / "good").write_text('Rate {last_answer} after {prompt} ({metadata}) as {{"score": x}}')
    assert "{last_answer}" in load_template(tmp_path / "good")
    (tmp_path / "bad").write_text("Rate {answer}")
    with pytest.raises(ValueError, match="fields are"):
        load_template(tmp_path / "bad")
    judge = JudgeScorer(parse_scorer("j=judge:http://h:1/v1/#m"), DEFAULT_TEMPLATE)
    assert (judge.url, judge.model) == ("http://h:1/v1/chat/completions", "m")
    with pytest.raises(ValueError, match="--tokenizer"):
        judge.prompt(_document(random.Random(4)))


def test_the_document_has_the_trajectory_s_text_with_a_tokenizer(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trajectory = make_trajectory(random.Random(5))
    raw = trajectory.model_dump()
    assert scoring_document(raw, None) is raw
    document = scoring_document(raw, tokenizer)
    ids = trajectory.token_ids
    assert document["transcript"] == tokenizer.decode(ids)
    assert document["prompt"] == tokenizer.decode(ids[: trajectory.prompt_length])
    first, second = trajectory.turns
    assert document["turns"][0]["text"] == tokenizer.decode(ids[first.start : first.start + first.length])
    assert document["turns"][1]["context"] == tokenizer.decode(ids[first.start + first.length : second.start])
    assert "transcript" not in raw and "text" not in raw["turns"][0]  # the published form is left as it was
    prompt = JudgeScorer(parse_scorer("j=judge:http://h/v1#m"), load_template(None)).prompt(document)
    assert document["transcript"] in prompt and '{"score": S}' in prompt


# -- flags ---------------------------------------------------------------------------------------


def _reward_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_scorer_flags(parser)
    return parser.parse_args(list(argv))


def test_scorer_flags_make_the_worker_s_configuration() -> None:
    args = _reward_args(
        "--scorer", "fn=python:tests.support.scorers:length", "--scorer", "j=judge:http://h/v1#m",
        "--scorer-timeout", "12", "--scorer-timeout", "j=90", "--scorer-retries", "fn=0",
        "--scorer-concurrency", "3", "--tokenizer", "tiny=/models/tiny",
    )  # fmt: skip
    config = reward_worker_config(args, ("nats://x:4222",), NatsAuth(), ConsumerStreams())
    fn, judge = config.scorers
    assert (fn.timeout_s, fn.retries, fn.concurrency) == (12.0, 0, 3)
    assert (judge.timeout_s, judge.retries, judge.concurrency) == (90.0, 1, 3)
    assert config.tokenizers == {"tiny": "/models/tiny"}
    with pytest.raises(ValueError, match="no scorer 'x'"):
        reward_worker_config(_reward_args("--scorer", "a=command:v", "--scorer-timeout", "x=1"), (), NatsAuth(),
                             ConsumerStreams())  # fmt: skip
    with pytest.raises(ValueError, match="--scorer a: No module named 'no_such_module'"):  # refused at start
        reward_worker_config(_reward_args("--scorer", "a=python:no_such_module:f"), (), NatsAuth(), ConsumerStreams())
    with pytest.raises(ValueError, match="--tokenizer"):
        reward_worker_config(_reward_args("--scorer", "j=judge:http://h/v1#m"), (), NatsAuth(), ConsumerStreams())
    up_given = reward_worker_config(_reward_args("--scorer", "j=judge:http://h/v1#m"), (), NatsAuth(),
                                    ConsumerStreams(), tokenizers={"tiny": "/served"})  # fmt: skip
    assert up_given.tokenizers == {"tiny": "/served"}
    with pytest.raises(ValueError, match="no scorer"):
        reward_worker_config(_reward_args(), (), NatsAuth(), ConsumerStreams())


def test_batch_flags_take_the_formula_and_the_waits() -> None:
    parser = argparse.ArgumentParser()
    add_batch_flags(parser)
    args = parser.parse_args(["--reward", "0.7*judge+0.3*tests", "--await-scorer", "judge:30",
                              "--await-scorer", "tests:2.5"])  # fmt: skip
    assert (args.reward, args.await_scorer) == ("0.7*judge+0.3*tests", [("judge", 30.0), ("tests", 2.5)])
    with pytest.raises(SystemExit):
        parser.parse_args(["--await-scorer", "judge"])


def test_up_refuses_rewards_it_cannot_make_before_it_starts_anything(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from stream_stack.cli import main

    argv = ["up", "--data-dir", str(tmp_path), "--scorer", "a=python:m:f", "--scorer", "b=command:v"]
    assert main(argv) == 2
    assert "say how they make a reward with --reward" in capsys.readouterr().err
    assert main([*argv, "--reward", "a+b", "--await-scorer", "c:5"]) == 2
    assert "await only scorers --reward names" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no NATS store, nothing started


def test_up_makes_its_reward_choices_explicit() -> None:
    """One scorer is the reward and is awaited 60 s; several need --reward; the banner says which
    scorers run, the formula, the waits and what a trajectory with neither feedback nor score becomes."""
    from stream_stack.cli import _reward_lines, _up_rewards, parser

    args = parser().parse_args(["up", "--scorer", "judge=judge:http://h/v1#m"])
    _up_rewards(args)
    assert (args.reward, args.await_scorer, args.default_reward) == ("judge", [("judge", 60.0)], 0.0)
    args = parser().parse_args(["up", "--scorer", "a=python:m:f", "--scorer", "b=command:v"])
    with pytest.raises(ValueError, match=re.escape("--reward 0.5*a+0.5*b")):
        _up_rewards(args)
    args = parser().parse_args(["up", "--scorer", "a=python:m:f", "--reward", "a+c"])
    with pytest.raises(ValueError, match="no --scorer c"):
        _up_rewards(args)
    args = parser().parse_args(["up", "--reward", "a+c", "--await-scorer", "a:5"])  # scored by workers of its own
    _up_rewards(args)
    assert (args.reward, args.await_scorer) == ("a+c", [("a", 5.0)])
    assert parser().parse_args(["up", "--default-reward", "none"]).default_reward is None

    from consumers.assembler import AssemblerConfig
    from consumers.reward_worker import RewardWorkerConfig

    args = parser().parse_args(["up", "--scorer", "tests=command:v", "--await-scorer", "tests:5"])
    _up_rewards(args)
    batcher = BatcherConfig(reward=args.reward, await_scorers=tuple(args.await_scorer))
    worker = RewardWorkerConfig(scorers=(parse_scorer("tests=command:v"),), metrics_port=8002)
    lines = _reward_lines(AssemblerConfig(default_reward=0.0), batcher, worker, "127.0.0.1")
    assert lines == [
        "  rewards        reward worker: tests (command:v); metrics http://127.0.0.1:8002/metrics",
        "                 reward = tests (a user's feedback wins); awaited: tests up to 5 s",
        "                 without feedback or every score: reward 0 (--default-reward: a placeholder, not a "
        'judgement; reward_source "default"), flagged unscored',
    ]
    [elsewhere, _, _] = _reward_lines(AssemblerConfig(default_reward=0.0), batcher, None, "127.0.0.1")
    assert elsewhere.endswith("none here: scores from stream-gateway reward processes of your own on this NATS")
    [alone] = _reward_lines(AssemblerConfig(default_reward=None), BatcherConfig(), None, "127.0.0.1")
    assert alone == ("  rewards        feedback only: no scorer runs (--scorer NAME=SPEC); "
                     "without feedback: dropped (--default-reward none)")  # fmt: skip
