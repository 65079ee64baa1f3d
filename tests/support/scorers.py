"""Scorers for the reward worker's tests, each a pure function of the trajectory's document.

* ``python:tests.support.scorers:length`` (and ``slow_length``, ``async_length``): a score, per-turn
  scores and a named part, from the ids alone;
* ``command:<python> tests/support/scorers.py``: the verifier run as a command (standard library
  only, so it starts fast): the document on stdin, ``{"score": ...}`` on stdout; ``--fail`` makes
  it exit 1, ``--hang FILE`` sleep for ever with a child that does too (their pids in FILE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any


def verified(document: dict[str, Any]) -> float:
    """The verifier's score: which share of the sampled ids are even (a stand-in for tests passing)."""
    sampled = [i for i, m in zip(document["token_ids"], document["loss_mask"], strict=True) if m]
    return round(sum(1 for i in sampled if i % 2 == 0) / max(1, len(sampled)), 6)


def length(document: dict[str, Any]) -> dict[str, Any]:
    """``score``: the ids over 100; ``turns``: each turn's length over 10; ``long``: a part."""
    return {
        "score": len(document["token_ids"]) / 100,
        "turns": [turn["length"] / 10 for turn in document["turns"]],
        "long": float(len(document["token_ids"]) > 20),
        "note": "ignored: not a number",
    }


def slow_length(document: dict[str, Any]) -> dict[str, Any]:
    """:func:`length`, after 50 ms (a plain function: the worker runs it in a thread)."""
    time.sleep(0.05)
    return length(document)


async def async_length(document: dict[str, Any]) -> dict[str, Any]:
    """:func:`length` as a coroutine function."""
    return length(document)


def main() -> None:
    if "--hang" in sys.argv:  # --hang FILE: writes its pid and its child's there, then sleeps
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(sys.argv[sys.argv.index("--hang") + 1], "w") as pids:
            pids.write(f"{os.getpid()} {child.pid}")
        time.sleep(3600)
    document = json.load(sys.stdin)
    if "--fail" in sys.argv:
        print("the tests failed to build", file=sys.stderr)
        raise SystemExit(1)
    print(json.dumps({"score": verified(document), "checked": len(document["token_ids"])}))


if __name__ == "__main__":
    main()
