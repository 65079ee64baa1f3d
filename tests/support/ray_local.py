"""A local Ray of one node for a test, its start not failed by a busy machine.

``ray.init()`` (Ray 2.60, read) starts the raylet, which starts the dashboard agent (a Python
process with heavy imports, started even with ``include_dashboard=False``) and waits at most 15 s
for it to write its ports to files, aborting when it is late. With the suite's other process and
its servers on the two cores the agent once took 24 s: ``ray.init`` failed with "The current node
timed out during startup" (a fresh-clone run; reproduced at will by an agent made to sleep 25 s
first). The node is then started again, up to three times: the test is about verl on Ray, not about
how fast Ray starts. (Giving the raylet the agents' ports, so that it waits for none, was tried: its
workers then missed their 60-s registration in fresh-clone runs, once for good.)

Ray's shutdown (``Node._kill_process_impl``) gives a process 1 s to exit after its SIGTERM, then a
SIGKILL and 1 s more, and drops its ``Popen`` whether or not it exited: under load one had not, and
its ``ResourceWarning`` ("subprocess N is still running") failed a test (CI, at 0270a4d). Every
``Popen`` made during the block is therefore held across the shutdown and reaped after it, killed
first if still running. (The tests run this in a child process now, tests/support/ray_child.py,
where nothing Ray leaves reaches pytest; this keeps the child's exit clean.)

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
def local_ray(num_cpus: int, namespace: str, pythonpath: Path, temp_dir: str | None = None) -> Iterator[None]:
    """A Ray node with ``num_cpus`` (a scheduling count, not cores), the driver connected in
    ``namespace``; its workers import from ``pythonpath``; its sessions and logs under ``temp_dir``
    (Ray's default, /tmp/ray, if None). Stopped, processes and all, on exit."""
    import ray

    existing = _popens()  # held: while they live, no new Popen can take one of their ids
    before = {id(p) for p in existing}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PYTHONPATH", str(pythonpath))  # the raylet passes its environment to the workers
            patch.setenv("RAY_worker_niceness", "0")
            _start(num_cpus, namespace, before, temp_dir)
            try:
                yield
            finally:
                made = [p for p in _popens() if id(p) not in before]  # held across the shutdown, which drops them
                ray.shutdown()
                _reap(before)
                del made
    finally:
        _reap(before)


def _start(num_cpus: int, namespace: str, before: set[int], temp_dir: str | None) -> None:
    """``ray.init``, again after Ray's own "timed out during startup" (at most ``_STARTS`` times)."""
    import ray

    for attempt in range(_STARTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ray's own start-up warnings are not ours to judge
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, namespace=namespace,
                         _temp_dir=temp_dir)  # fmt: skip
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
