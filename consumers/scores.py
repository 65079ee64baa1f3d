"""Scores: what the reward worker records per trajectory and scorer, and the reward the batcher makes of them.

A score is a :class:`ScoreRecord` in the key-value bucket ``sg_scores``, one key per trajectory and
scorer (:func:`score_key`)::

    <tenant token>.<session token>.<trajectory id>.<scorer>

written with ``kv.create``, which fails when the key exists: a trajectory is scored once per scorer
whichever worker ran it and however often it was delivered. The tokens are the events' subject
tokens (:func:`pipeline.events.subject_token`), so ``stream-gateway forget`` purges a session's
scores with its other records. A record says one of three things (``status``): ``scored`` (``score``,
the named ``parts``, and per-turn ``turns``), ``timeout`` or ``error`` (``error`` says what); a
judge's answer is kept in ``answer`` beside its score.

:class:`RewardFormula` is the batcher's ``--reward``: one scorer (``judge``), a named part of one
(``tests.passed``), or a weighted sum (``0.7*judge+0.3*tests``, ``judge-0.1*length``).
:func:`apply_scores` gives a trajectory the formula's reward. Deliberate choices:

* **Every term or none.** When a term has no score (timed out, failed, not recorded yet), the
  formula is not computed over the others, whose scale would differ: the trajectory keeps the
  reward the assembler gave it (feedback, the default reward, or none) and carries the health flag
  ``unscored``, so a row trained without its scores says so.
* **A live user's feedback wins**, as over a reward function (:mod:`consumers.rewards`): a
  trajectory whose reward came from session feedback keeps it; its scores stay in the bucket.
* **Per turn**, the same formula over the per-turn scores: a turn gets it as its ``reward`` when
  every term has a score for that turn (a term naming a part has none per turn), unless a user
  rated that turn. A scorer gives per-turn scores as a list, one per turn of the trajectory in
  order; the worker keys them by turn id.
* Records never change once written, so applying the scores again to a trajectory they were
  applied to gives the same trajectory, or one with more of the formula's terms.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import orjson
from pipeline.events import subject_token
from pydantic import BaseModel, ConfigDict, Field

from .trajectory import HEALTH_FLAGS, Trajectory

__all__ = ["SCORER_NAME", "RewardFormula", "ScoreRecord", "apply_scores", "score_key"]

SCORER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
"""A scorer's name: a key token, and a name in a formula (no ``-``: that is subtraction)."""

_TERM = re.compile(
    r"\s*(?P<sign>[+-])?\s*(?:(?P<weight>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*\*\s*)?"
    r"(?P<name>[A-Za-z_]\w*)(?:\.(?P<part>\w+))?\s*"
)


def score_key(tenant: str, session_id: str, trajectory_id: str, scorer: str) -> str:
    """The ``sg_scores`` key of one trajectory's score by one scorer (module docstring)."""
    return f"{subject_token(tenant)}.{subject_token(session_id)}.{trajectory_id}.{scorer}"


class ScoreRecord(BaseModel):
    """One scorer's verdict on one trajectory, as stored in ``sg_scores``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    trajectory_id: str
    session_id: str
    tenant: str
    scorer: str = Field(description="the scorer's name (--scorer NAME=SPEC)")
    kind: Literal["python", "command", "judge", "signals"]
    status: Literal["scored", "timeout", "error"]
    score: float | None = Field(None, allow_inf_nan=False, description="the scorer's score; null: none given")
    parts: dict[str, float] = Field(default_factory=dict, description="named numbers the scorer gave besides")
    turns: dict[str, float] = Field(default_factory=dict, description="per-turn scores, by turn id")
    answer: str | None = Field(None, description="a judge's answer (its first 4000 characters)")
    error: str | None = Field(None, description="why there is no score (timeout, error)")
    attempts: int = Field(ge=1, description="tries it took (1 + retries used)")
    duration_s: float = Field(ge=0, description="seconds from the first try to the verdict")
    worker: str = Field(description="the worker that recorded it (host:pid)")
    at: float = Field(description="when it was recorded, Unix seconds")

    def value(self, part: str | None = None) -> float | None:
        """The score (or the named ``part``) if this record scored, else ``None``."""
        if self.status != "scored":
            return None
        return self.score if part is None else self.parts.get(part)

    def encode(self) -> bytes:
        """The wire form: compact JSON."""
        return orjson.dumps(self.model_dump(mode="python"))

    @classmethod
    def decode(cls, data: bytes | str) -> ScoreRecord:
        """Parse and validate."""
        return cls.model_validate_json(data)


@dataclass(frozen=True, slots=True)
class _Term:
    weight: float
    scorer: str
    part: str | None


@dataclass(frozen=True, slots=True)
class RewardFormula:
    """A weighted sum of scores (``--reward``): ``judge``, ``tests.passed``, ``0.7*judge+0.3*tests``."""

    text: str  # as given, without spaces: the trajectories' reward_source
    terms: tuple[_Term, ...]

    @classmethod
    def parse(cls, text: str) -> RewardFormula:
        """Parse ``[w*]name[.part] (+|- [w*]name[.part])...``; a clear ``ValueError`` otherwise."""
        terms: list[_Term] = []
        position = 0
        while position < len(text):
            match = _TERM.match(text, position)
            if match is None or match.end() == position or (terms and match["sign"] is None):
                raise ValueError(f"--reward {text!r}: expected terms like 0.7*judge+0.3*tests at {text[position:]!r}")
            weight = float(match["weight"] or 1.0) * (-1.0 if match["sign"] == "-" else 1.0)
            if SCORER_NAME.fullmatch(match["name"]) is None:
                raise ValueError(f"--reward {text!r}: {match['name']!r} is not a scorer name")
            terms.append(_Term(weight, match["name"], match["part"]))
            position = match.end()
        if not terms:
            raise ValueError("--reward: empty")
        return cls("".join(text.split()), tuple(terms))

    @property
    def scorers(self) -> frozenset[str]:
        """The scorers it needs."""
        return frozenset(term.scorer for term in self.terms)

    def combine(self, records: Mapping[str, ScoreRecord]) -> float | None:
        """The reward over ``records`` (by scorer name); ``None`` when a term has no score."""
        total = 0.0
        for term in self.terms:
            record = records.get(term.scorer)
            value = None if record is None else record.value(term.part)
            if value is None:
                return None
            total += term.weight * value
        return total if math.isfinite(total) else None

    def combine_turn(self, records: Mapping[str, ScoreRecord], turn_id: str) -> float | None:
        """The reward of one turn over its per-turn scores; ``None`` when a term has none for it."""
        total = 0.0
        for term in self.terms:
            record = records.get(term.scorer)
            value = None if record is None or record.status != "scored" or term.part else record.turns.get(turn_id)
            if value is None:
                return None
            total += term.weight * value
        return total if math.isfinite(total) else None


def apply_scores(trajectory: Trajectory, records: Mapping[str, ScoreRecord], formula: RewardFormula) -> Trajectory:
    """``trajectory`` with the formula's reward over ``records`` (module docstring for the rules)."""
    reward = formula.combine(records)
    turns = []
    for turn in trajectory.turns:  # a turn a user rated keeps that rating
        value = None if turn.reward is not None else formula.combine_turn(records, turn.turn_id)
        turns.append(turn if value is None else turn.model_copy(update={"reward": value}))
    out = trajectory.model_copy(update={"turns": turns}) if turns != trajectory.turns else trajectory
    if trajectory.reward_source == "feedback":
        unscored = False
    elif reward is None:
        unscored = True
    else:
        out, unscored = out.rewarded(reward, formula.text), False
    if unscored != ("unscored" in out.health):
        flags = {*out.health, "unscored"} if unscored else set(out.health) - {"unscored"}
        out = out.model_copy(update={"health": [flag for flag in HEALTH_FLAGS if flag in flags]})
    return out
