"""A local Ray of one node for a test, its start not failed by a busy machine.

``ray.init()`` (Ray 2.60, read) starts the raylet, which starts the dashboard agent (a Python
process with heavy imports, started even with ``include_dashboard=False``) and waits at most 15 s
for it to write its ports to files, aborting when it is late. With the suite's other process and
its servers on the two cores the agent once took 24 s: ``ray.init`` failed with "The current node
timed out during startup" (a fresh-clone run; reproduced at will by an agent made to sleep 25 s
first). The node is then started again, up to three times: the test is about verl on Ray, not about
how fast Ray starts. (Giving the raylet the agents' ports, so that it waits for none, was tried: its
workers then missed their 60-s registration in fresh-clone runs, once for good.)

Ray's shutdown reaps the processes it tracks, but once in a fresh-clone run a subprocess it had
started was left unwaited, and the next test failed on its ``ResourceWarning`` ("subprocess N is still
running"): every ``Popen`` made during the block is reaped when it ends, killed first if still running.

Ray also starts its workers at niceness 15, where beside the suite's other process they got so
little of the CPU that the worker-group test took 150-240 s instead of 15: they run at 0 here.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["local_ray"]

log = logging.getLogger(__name__)

_STARTS = 3  # Ray's node is started at most this many times


@contextmanager
def local_ray(num_cpus: int, namespace: str, pythonpath: Path) -> Iterator[None]:
    """A Ray node with ``num_cpus`` (a scheduling count, not cores), the driver connected in
    ``namespace``; its workers import from ``pythonpath``. Stopped, processes and all, on exit."""
    import ray

    before = {id(p) for p in _popens()}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PYTHONPATH", str(pythonpath))  # the raylet passes its environment to the workers
            patch.setenv("RAY_worker_niceness", "0")
            _start(num_cpus, namespace, before)
            try:
                yield
            finally:
                ray.shutdown()
    finally:
        _reap(before)


def _start(num_cpus: int, namespace: str, before: set[int]) -> None:
    """``ray.init``, again after Ray's own "timed out during startup" (at most ``_STARTS`` times)."""
    import ray

    for attempt in range(_STARTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ray's own start-up warnings are not ours to judge
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, namespace=namespace)
            return
        except Exception as exc:
            _reap(before)  # the failed start's processes (gcs_server...), while exc still holds them
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == _STARTS - 1:
                raise
            log.warning("Ray's node did not start in time (%s); starting it again", exc)


def _popens() -> list[subprocess.Popen[bytes]]:
    return [o for o in gc.get_objects() if issubclass(type(o), subprocess.Popen)]  # (type: no proxy's __class__)


def _reap(before: set[int]) -> None:
    """Wait for every ``Popen`` not in ``before``, killing it first if it still runs (no
    ``gc.collect()`` first: a ``Popen`` in garbage would warn as it went, and get_objects sees garbage)."""
    for process in _popens():
        if id(process) in before or process.poll() is not None:
            continue
        log.warning("Ray left a process running (%s): killing it", process.args)
        process.kill()
        process.wait(60)
