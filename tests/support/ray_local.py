"""A local Ray of one node for a test, started so that a busy machine cannot fail its start.

``ray.init()`` (Ray 2.60, read) starts the raylet, which starts the dashboard agent and the
runtime-env agent (Python processes with heavy imports, started even with
``include_dashboard=False``) and then waits for each to write the ports it chose to files, at most
15 s a port, aborting when one is late. With the suite's other process and its servers on the two
cores, the dashboard agent once took 24 s to start: the raylet aborted and ``ray.init`` failed with
"The current node timed out during startup" (a fresh-clone run; reproduced at will by an agent that
sleeps 25 s first). The raylet waits for no port it was given, and ``ray.init`` takes none of these
ports, so the node is started by Ray's own test utility (:class:`ray.cluster_utils.Cluster`, whose
head-node arguments are ``RayParams``) with ports chosen here, and the driver connects to it; the
one port Ray passes to the agent and not to the raylet is added to the raylet's command. With the
25-s agent, the node is up in 7 s and runs a task.

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
from typing import Any

import pytest

from .servers import free_port

__all__ = ["local_ray"]

log = logging.getLogger(__name__)


@contextmanager
def local_ray(num_cpus: int, namespace: str, pythonpath: Path) -> Iterator[None]:
    """A Ray node with ``num_cpus`` (a scheduling count, not cores), the driver connected in
    ``namespace``; its workers import from ``pythonpath``. Stopped, processes and all, on exit."""
    import ray
    from ray.cluster_utils import Cluster

    ports = {
        "metrics_agent_port": free_port(),
        "metrics_export_port": free_port(),
        "dashboard_agent_listen_port": free_port(),
        "runtime_env_agent_port": free_port(),
    }
    before = {id(p) for p in _popens()}
    with _reaped(before), pytest.MonkeyPatch.context() as patch:
        _tell_the_raylet(patch, ports["dashboard_agent_listen_port"])
        patch.setenv("PYTHONPATH", str(pythonpath))  # the raylet passes its environment to the workers
        patch.setenv("RAY_worker_niceness", "0")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ray's own start-up warnings are not ours to judge
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": num_cpus,
                    "include_dashboard": False,
                    "object_store_memory": 512 * 1024 * 1024,
                    **ports,
                },
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
            yield
        finally:
            try:
                ray.shutdown()
            finally:
                cluster.shutdown()


def _tell_the_raylet(patch: pytest.MonkeyPatch, listen_port: int) -> None:
    """Ray 2.60 gives the dashboard agent its listen port but not the raylet, which then waits for
    the agent's file all the same: the raylet's command gets its own flag for it."""
    from ray._private import ray_constants, services

    start = services.start_ray_process

    def start_ray_process(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = [*command, f"--dashboard_agent_listen_port={listen_port}"]
        return start(command, process_type, *args, **kwargs)

    patch.setattr(services, "start_ray_process", start_ray_process)


def _popens() -> list[subprocess.Popen[bytes]]:
    return [o for o in gc.get_objects() if issubclass(type(o), subprocess.Popen)]  # (type: no proxy's __class__)


@contextmanager
def _reaped(before: set[int]) -> Iterator[None]:
    """On exit, wait for every ``Popen`` made since ``before`` (killing it if it still runs)."""
    try:
        yield
    finally:  # (no gc.collect() first: a Popen in garbage would warn as it went; get_objects sees garbage)
        for process in _popens():
            if id(process) in before or process.poll() is not None:
                continue
            log.warning("Ray left a process running (%s): killing it", process.args)
            process.kill()
            process.wait(60)
