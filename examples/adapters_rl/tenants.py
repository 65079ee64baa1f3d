"""The tenants: who they are, what their users reward, and every score the users gave.

Two tenants share one gateway and one base model, each bound to its own LoRA adapter by its key
(``key tenant adapter=NAME`` in the key file); a third key is unbound and talks to the base model
itself, as a control. Every reward is a share of the characters of everything the assistant said
in a session, so any reply can be scored with any tenant's reward:

* tenant **alpha** rewards digits (``digit_fraction``, online_rl's reward): the share of the
  non-whitespace characters that are ``0``-``9``. The random ``tiny`` model starts at about 0.001.
* tenant **beta** rewards ASCII punctuation (:func:`punctuation_fraction`): the share of the
  non-whitespace characters in ``string.punctuation`` (``{}[]",:;.!?`` and the like). It starts
  at about 0.05: the tokenizer has 94 tokens made of punctuation alone, JSON fragments such as
  ``"},`` among them.

The two character classes are disjoint, so a reply that is all of one scores 0 on the other.
:class:`Scorer` is the reward a tenant's users send as feedback; it also records, for every rated
session, its own score and the other tenant's score of the same text (the leakage measurement).
"""

from __future__ import annotations

import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from simulated_users import digit_fraction

__all__ = ["TENANTS", "Rating", "Scorer", "Tenant", "punctuation_fraction", "write_key_file"]

_PUNCTUATION = frozenset(string.punctuation)


def punctuation_fraction(text: str) -> float:
    """The share of the non-whitespace characters that are ASCII punctuation (0.0 for no text)."""
    characters = [c for c in text if not c.isspace()]
    if not characters:
        return 0.0
    return sum(c in _PUNCTUATION for c in characters) / len(characters)


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant of the gateway: its key, and the adapter it is bound to (``None``: the base model)."""

    name: str
    key: str
    adapter: str | None
    rewards: str  # what its users reward, in words
    reward: Callable[[str], float]


ALPHA = Tenant("tenant-alpha", "sk-alpha", "alpha", "digits", digit_fraction)
BETA = Tenant("tenant-beta", "sk-beta", "beta", "punctuation", punctuation_fraction)
BASE = Tenant("tenant-base", "sk-base", None, "nothing (a control: the base model, never trained)", digit_fraction)
TENANTS = (ALPHA, BETA, BASE)
# Every reply is scored by both rewards.
REWARDS: dict[str, Callable[[str], float]] = {"digits": digit_fraction, "punctuation": punctuation_fraction}


def write_key_file(path: Path) -> None:
    """``key tenant [adapter=NAME]``, one line per tenant (the gateway's ``--api-key-file``)."""
    lines = [f"{t.key} {t.name}" + (f" adapter={t.adapter}" if t.adapter else "") for t in TENANTS]
    path.write_text("\n".join(lines) + "\n")


@dataclass(frozen=True, slots=True)
class Rating:
    """One rated session: when (seconds since the users started) and what both rewards say of it."""

    t: float
    scores: dict[str, float]  # by reward name: "digits", "punctuation"
    text: str


@dataclass(slots=True)
class Scorer:
    """A tenant's users' reward (``UserTraffic(reward=...)``), recording every session it scores."""

    tenant: Tenant
    started: float = field(default_factory=time.monotonic)
    ratings: list[Rating] = field(default_factory=list)

    def __call__(self, text: str) -> float:
        scores = {name: reward(text) for name, reward in REWARDS.items()}
        self.ratings.append(Rating(time.monotonic() - self.started, scores, text))
        return 0.0 if self.tenant.adapter is None else self.tenant.reward(text)
