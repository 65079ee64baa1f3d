"""Programmatic rewards: a user's ``module:function`` scoring trajectories in the assembler.

``stream-gateway assemble --reward-function package.module:function`` names a function that
takes a :class:`~consumers.trajectory.Trajectory` and returns a float or ``None``; it may be
``async``. :func:`load_reward_function` imports it, :func:`apply_reward` calls it on one
trajectory.

Deliberate choices:

* **A live user's score wins.** A trajectory whose reward came from session feedback is not
  scored again: the function only fills in what nobody rated.
* **A broken function does not stop the assembler.** An exception or a timeout is logged and
  counts as ``None``, like an explicit ``None``: the trajectory gets the default reward if one is
  configured, else none (what to do with those is the batcher's policy).
* The time limit is a cancel scope around the call (and its awaiting), not a parameter the
  function has to honour.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Awaitable, Callable

import anyio

from .trajectory import Trajectory

__all__ = ["RewardFunction", "apply_reward", "load_reward_function"]

log = logging.getLogger(__name__)

RewardFunction = Callable[[Trajectory], "float | Awaitable[float | None] | None"]


def load_reward_function(spec: str) -> RewardFunction:
    """``"package.module:function"`` → the function; a clear error if either is missing."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"reward function {spec!r}: expected 'module:function'")
    function = getattr(importlib.import_module(module_name), name, None)
    if not callable(function):
        raise ValueError(f"reward function {spec!r}: {module_name} has no callable {name!r}")
    return function  # type: ignore[no-any-return]


async def apply_reward(
    trajectory: Trajectory,
    function: RewardFunction,
    *,
    name: str,
    timeout_s: float,
    default_reward: float | None,
) -> Trajectory:
    """The trajectory with ``function``'s reward (``reward_source`` = ``name``), or the default's."""
    if trajectory.reward_source == "feedback":
        return trajectory  # a live user's score wins over a program's
    try:
        with anyio.fail_after(timeout_s):
            value = function(trajectory)
            if inspect.isawaitable(value):
                value = await value
    except Exception as exc:  # a broken reward function must not stop the assembler
        log.warning("reward function %s failed on %s: %r", name, trajectory.trajectory_id, exc)
        value = None
    if value is None:
        value, source = default_reward, "default" if default_reward is not None else None
    else:
        source = name
    return trajectory.rewarded(None if value is None else float(value), source)
