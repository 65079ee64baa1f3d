"""Implicit signals: what live users said about each turn without pressing a button, and their reward.

The gateway sees a user regenerate an answer, edit the message before it, feed back a failed tool
call, leave during a stream, or carry the conversation on. What is known when a turn ends
(``abandoned``: its ``turn.aborted`` reason is ``client_disconnected``) is on its own event; what
only a later request can say (``retried``, ``edited``, ``tool_error``) is on that later turn's
event, naming the earlier turn (``signals``, :class:`pipeline.events.SignalRecord`); ``accepted`` is
the session's tree itself (a later turn continues it: a child, or a new root naming it as its
predecessor or as the turn it continues after a compaction). :func:`turn_signals` folds them all
onto the turns they concern, so each :class:`~consumers.trajectory.TurnSummary` lists its own.

:func:`signals_answer` is the built-in scorer ``signals`` (``--scorer sig=signals``, or
``sig=signals:retried=-2,accepted=0.5`` to change weights): each turn scores the sum of its
signals' weights, clamped to [-1, 1] (a turn without signals scores 0); the trajectory scores the
mean of its turns' scores. The weights (:data:`DEFAULT_WEIGHTS`) and why:

* ``accepted`` +1: the user went on with the answer, the weakest sign of approval but the commonest;
* ``retried`` -1: the user asked for the same answer again, the clearest sign of rejection;
* ``edited`` -0.5: the user changed the question; the answer may have been fine for what was asked;
* ``tool_error`` -0.5: a call the turn made failed (the model's arguments, or the tool's fault);
* ``abandoned`` -1: the user left during the stream.

A turn both accepted and retried (the user went on, then came back and regenerated it) scores 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline.events import Event, TurnAborted, TurnRecord

__all__ = ["DEFAULT_WEIGHTS", "SIGNALS", "parse_weights", "signals_answer", "turn_signals"]

SIGNALS = ("accepted", "retried", "edited", "tool_error", "abandoned")
"""Every implicit signal, in the order a turn lists them."""

DEFAULT_WEIGHTS: Mapping[str, float] = {
    "accepted": 1.0,
    "retried": -1.0,
    "edited": -0.5,
    "tool_error": -0.5,
    "abandoned": -1.0,
}
"""Each signal's weight in the ``signals`` scorer (the module docstring says why)."""


def turn_signals(events: Iterable[Event]) -> dict[str, list[str]]:
    """Every turn's signals (in :data:`SIGNALS`'s order), by turn id, from a session's events."""
    records = [e for e in events if isinstance(e, TurnRecord)]
    found: dict[str, set[str]] = {r.turn_id: set() for r in records}
    for record in records:
        if isinstance(record, TurnAborted) and record.reason == "client_disconnected":
            found[record.turn_id].add("abandoned")
        for earlier in (record.parent_turn_id, record.predecessor_turn_id, record.continues_turn_id):
            if earlier is not None:
                found.setdefault(earlier, set()).add("accepted")
        for said in record.signals:
            found.setdefault(said.turn_id, set()).add(said.signal)
    return {turn_id: [s for s in SIGNALS if s in names] for turn_id, names in found.items()}


def parse_weights(text: str) -> dict[str, float]:
    """``retried=-2,accepted=0.5``: the default weights with these changed ("" keeps them all)."""
    weights = dict(DEFAULT_WEIGHTS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = item.partition("=")
        if not equals or name not in weights:
            raise ValueError(f"signals:{text}: expected SIGNAL=WEIGHT, SIGNAL one of {', '.join(SIGNALS)}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"signals:{text}: {value!r} is not a number") from None
        if not math.isfinite(weight):
            raise ValueError(f"signals:{text}: {value!r} is not finite")
        weights[name] = weight
    return weights


def signals_answer(document: Mapping[str, Any], weights: Mapping[str, float]) -> dict[str, Any]:
    """The ``signals`` scorer's answer for a trajectory's document: per-turn scores (each the sum of
    its signals' weights, clamped to [-1, 1]) and their mean as ``score``; each signal's count is a
    part (``sig.retried`` in a formula)."""
    turns = [
        max(-1.0, min(1.0, sum(weights[s] for s in turn.get("signals") or () if s in weights)))
        for turn in document["turns"]
    ]
    counts = {name: float(sum(name in (turn.get("signals") or ()) for turn in document["turns"])) for name in SIGNALS}
    return {"score": sum(turns) / len(turns) if turns else 0.0, "turns": turns, **counts}
