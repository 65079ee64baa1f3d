"""Process helpers shared by the benchmarks: free ports, CPU seconds and memory from ``/proc``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
LOADGEN = Path(__file__).with_name("loadgen.py")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads), in 10 ms ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def precise_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s live threads, to the nanosecond: the sum of each thread's run time in
    ``/proc/<pid>/task/*/schedstat``. For one request's cost, where :func:`cpu_s`'s 10 ms ticks are
    the size of what is measured; a thread that exits between two readings takes its time with it
    (the gateway's event loop and worker threads live as long as it does)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited while we read
    return total / 1e9


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (a supervisor and its workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return cpu_s(pid) + sum(cpu_s(int(c)) for c in children)


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20


def wait_http(url: str, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Wait until ``url`` answers 200, or fail if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"{process.args!r} exited with {process.returncode} before answering {url}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.2)


def loadgen(
    url: str, model: str, streams: int, tokens: int, *, requests: int = 1, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """Run ``loadgen.py`` in a process of its own and return its JSON result."""
    return loadgens([url], model, streams, tokens, requests=requests, extra=extra)[0]


def loadgens(
    urls: Sequence[str], model: str, streams: int, tokens: int, *, requests: int = 1, extra: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """``loadgen.py`` against each of ``urls`` at the same time, each in a process of its own; their JSON results."""

    def command(url: str) -> list[str]:
        return [sys.executable, str(LOADGEN), "--url", url, "--model", model, "--streams", str(streams),
                "--tokens", str(tokens), "--requests", str(requests), *extra]  # fmt: skip

    processes = [subprocess.Popen(command(url), stdout=subprocess.PIPE, stderr=subprocess.PIPE) for url in urls]
    outputs = [process.communicate(timeout=900) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        if process.returncode != 0:
            raise SystemExit(f"load generator failed ({process.returncode}): {stderr.decode()[-2000:]}")
    return [orjson.loads(stdout) for stdout, _ in outputs]
