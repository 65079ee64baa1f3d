"""A test's Ray part in a process of its own: a start that hangs is killed and made again, a body
that hangs fails the test with Ray's logs, and nothing Ray leaves behind reaches pytest's process.

Why a process: once in a fresh-clone run ``ray.init`` (Ray 2.60) never returned. The driver was
inside its ``CoreWorker`` construction, in C++, and the raylet's two prestarted workers hung at the
same point; pytest-timeout's signal never ran, so the run would have waited for CI's 90-minute limit.
And once Ray's ``shutdown`` dropped a process that had not exited yet within its 1-s grace, whose
``ResourceWarning`` ("subprocess N is still running") then failed the test under pytest's
unraisable-exception hook. Both stay in the child here: the parent only waits on a pipe, which a
timeout can always interrupt.

:func:`run_in_ray` runs ``target(*args)`` in a spawned child that has started a local Ray node
(:func:`tests.support.ray_local.local_ray`, with a Ray temp directory of its own) and sends back its
result, or its traceback. The child sends ``started`` once ``ray.init`` returned; a child that does
not within ``START_S`` is killed with its process group (Ray's node with it) and started again once,
the only retry, since nothing of the test has run yet. A body still running at its deadline is
killed and the test fails with the tail of Ray's logs. While it runs, the child can ask the parent
to do what only the parent can (restart the test's NATS server): :func:`call_parent` names one of
the ``calls`` given to :func:`run_in_ray`. If the test's process dies (a crashed or killed pytest
worker), the child kills its own process group, Ray's node and agents with it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RayChild", "call_parent", "run_in_ray"]

log = logging.getLogger(__name__)

START_S = 180.0  # spawn, the target module's imports (torch, verl) and ray.init, beside the other test process
_STARTS = 2  # a start that hangs is made once more
_LOG_TAIL = 30  # lines of each Ray log quoted in a failure
_LOGS = ("raylet.", "gcs_server.", "python-core-driver", "python-core-worker")  # which of Ray's logs

_parent: multiprocessing.connection.Connection | None = None  # the child's end of the pipe


def call_parent(name: str, *args: Any) -> Any:
    """In the child: run the parent's ``calls[name](*args)`` and return its result."""
    if _parent is None:
        raise RuntimeError("call_parent is for the target of run_in_ray")
    _send(_parent, ("call", name, args))
    kind, value = _recv(_parent)
    if kind == "error":
        raise RuntimeError(f"the parent's {name} failed:\n{value}")
    return value


def _child(
    conn: multiprocessing.connection.Connection,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    num_cpus: int,
    namespace: str,
    pythonpath: Path,
    temp_dir: str,
) -> None:
    global _parent
    # A process group of its own, Ray's node in it: the parent kills them together. Not a session
    # of its own: the kernel would share CPU between it and the test's session first
    # (tests/support/vllm_server.py says what that did beside vLLM).
    os.setpgid(0, 0)
    _die_with_parent()
    _parent = conn
    from .ray_local import local_ray

    try:
        with local_ray(num_cpus, namespace, pythonpath, temp_dir=temp_dir):
            _send(conn, ("started", None))
            result = target(*args)
    except BaseException:
        _send(conn, ("failed", traceback.format_exc()))
    else:
        _send(conn, ("result", result))
    conn.close()


def _die_with_parent() -> None:
    """Kill this child's process group (the child, Ray's node and its agents) when the test's
    process dies, however it dies, so that a killed pytest leaves no Ray node behind. A thread
    waits on the parent's sentinel (it is ready once the parent is gone). Linux's
    ``PR_SET_PDEATHSIG`` would kill only the child: Ray's raylet and GCS die with it, but its
    dashboard and runtime-env agents were seen to live on under init."""
    parent = multiprocessing.parent_process()
    assert parent is not None

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="ray-child-parent-watch", daemon=True).start()


def _send(conn: multiprocessing.connection.Connection, message: tuple[Any, ...]) -> None:
    """Plain pickle, not the pipe's own: torch's reductions for multiprocessing share a tensor's
    storage by a file descriptor that dies with the child, which has often exited by the time its
    result is read."""
    conn.send_bytes(pickle.dumps(message))


def _recv(conn: multiprocessing.connection.Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class RayChild:
    """``target(*args)`` running in a child with a Ray node: :meth:`start` returns once Ray is up,
    :meth:`result` waits for the target (serving its :func:`call_parent` calls)."""

    def __init__(
        self,
        target: Callable[..., Any],
        *args: Any,
        num_cpus: int,
        namespace: str,
        pythonpath: Path,
        calls: dict[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.target, self.args = target, args
        self.num_cpus, self.namespace, self.pythonpath = num_cpus, namespace, pythonpath
        self.calls = calls or {}
        self.temp_dir = ""
        self._process: Any = None
        self._conn: multiprocessing.connection.Connection | None = None

    def start(self) -> None:
        for attempt in range(_STARTS):
            self._spawn()
            message = self._next(time.monotonic() + START_S)
            if message is not None and message[0] == "started":
                return
            logs = self._kill()
            if message is not None:  # it failed (or died) before Ray was up: not a hang
                raise AssertionError(f"the Ray child failed to start:\n{message[1]}\n{logs}")
            if attempt == _STARTS - 1:
                raise AssertionError(f"the Ray child did not start in {START_S:.0f} s, twice\n{logs}")
            log.warning("the Ray child did not start in %.0f s; killed, starting it again\n%s", START_S, logs)

    def result(self, timeout: float) -> Any:
        """The target's return value; its traceback as an AssertionError if it raised; killed past ``timeout``."""
        message = self._next(time.monotonic() + timeout)
        if message is None:
            raise AssertionError(f"the Ray child's target ran past {timeout:.0f} s: killed\n{self._kill()}")
        kind, value = message
        if kind == "result":
            self._finish()
            return value
        raise AssertionError(f"the Ray child's target failed:\n{value}\n{self._kill()}")

    def run(self, timeout: float) -> Any:
        """:meth:`start`, then :meth:`result`; the child killed whatever happens."""
        try:
            self.start()
            return self.result(timeout)
        finally:
            self.close()

    def finished(self) -> bool:
        """Whether the child has sent its last word (or died): :meth:`result` then returns at once.
        (A child that calls the parent is not finished when it calls.)"""
        return self._conn is not None and self._conn.poll(0)

    def close(self) -> None:
        if self._process is not None:
            self._kill()

    def _spawn(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        args = (child_end, self.target, self.args, self.num_cpus, self.namespace, self.pythonpath, self.temp_dir)
        self._process = context.Process(target=_child, args=args, name=f"ray-child-{self.namespace}")
        self._process.start()
        child_end.close()

    def _next(self, deadline: float) -> tuple[str, Any] | None:
        """The child's next message that is not a call (calls are served); ``None`` at the deadline."""
        assert self._conn is not None
        while (left := deadline - time.monotonic()) > 0:
            if not self._conn.poll(min(left, 1.0)):
                continue
            try:
                message = _recv(self._conn)
            except EOFError:
                self._process.join(5)
                return ("died", f"the child exited (code {self._process.exitcode}) without a word")
            if message[0] != "call":
                return (message[0], message[1])
            _, name, args = message
            try:
                _send(self._conn, ("reply", self.calls[name](*args)))
            except Exception:
                _send(self._conn, ("error", traceback.format_exc()))
        return None

    def _finish(self) -> None:
        """After the result: the child shuts Ray down and exits; killed if it does not within a minute."""
        self._process.join(60)
        if self._process.is_alive():
            log.warning("the Ray child did not exit after its result: killed\n%s", self._logs())
        self._kill(keep_logs=False)

    def _kill(self, keep_logs: bool = True) -> str:
        """Kill the child's process group (its Ray node), reap the child; the tail of Ray's logs."""
        process, self._process = self._process, None
        if process is None:
            return ""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or not yet its own group
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()
        process.join(30)
        if self._conn is not None:
            self._conn.close()
        logs = self._logs() if keep_logs else ""
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return logs

    def _logs(self) -> str:
        """The tails of the node's and the driver's logs (and any worker's that wrote an error)."""
        parts = []
        for path in sorted(Path(self.temp_dir).glob("session_2*/logs/*")):  # not session_latest, a link to it
            if not path.name.startswith(_LOGS) or not path.is_file() or not path.stat().st_size:
                continue
            lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL:]
            parts.append(f"--- {path.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "Ray's logs:\n" + "\n".join(parts) if parts else "Ray wrote no logs"


def run_in_ray(
    target: Callable[..., Any],
    *args: Any,
    num_cpus: int,
    namespace: str,
    pythonpath: Path,
    timeout: float,
    calls: dict[str, Callable[..., Any]] | None = None,
) -> Any:
    """``target(*args)`` in a child that started a Ray node; its result (see the module docstring)."""
    child = RayChild(target, *args, num_cpus=num_cpus, namespace=namespace, pythonpath=pythonpath, calls=calls)
    return child.run(timeout)
