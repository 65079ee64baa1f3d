"""``stream-gateway up`` as a child process: start it on free ports, wait until it serves, stop it.

The gateway, its embedded NATS, the assembler and the batcher all run in that one child, exactly
as a user would start them; this example only talks to it over HTTP and NATS. Choices:

* NATS ports are chosen by nats-server itself (``--nats-port 0``, ``--nats-monitor-port 0``); the
  URL it bound is read back from the ``NATS`` line that ``up`` prints when it is ready.
* ``up`` cannot report a port that uvicorn chose, so the HTTP port is found by binding port 0 and
  closing the socket (a short window in which another process could take it; fine for an example).
* The child's stdout and stderr go to a log file, not a pipe that nobody reads (a full pipe would
  block the gateway); the log is kept next to the results.
* The child runs in its own session, so a Ctrl-C in the terminal reaches this script alone; it stops
  the child by sending SIGINT, the Ctrl-C that ``up`` handles by draining events to NATS first; a
  child still alive after ``stop_timeout_s`` is killed.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
from anyio.abc import Process

__all__ = ["GatewayProcess", "free_port", "gateway_command", "prepare_model", "running_gateway"]

_NATS_LINE = re.compile(r"^stream-gateway:\s+NATS\s+(nats://\S+)")


@dataclass(frozen=True, slots=True)
class GatewayProcess:
    """Where a running ``stream-gateway up`` listens."""

    base_url: str  # http://127.0.0.1:<port>
    nats_url: str
    batch_dir: Path
    log_path: Path
    process: Process = field(repr=False, compare=False)

    async def fail_if_exits(self) -> None:
        """Wait; raise if the child exits (run it beside the work that needs the gateway, then cancel it)."""
        status = await self.process.wait()
        tail = "\n".join((await anyio.Path(self.log_path).read_text(errors="replace")).splitlines()[-5:])
        raise RuntimeError(f"stream-gateway up exited during the run (status {status}); {self.log_path} ends:\n{tail}")


def gateway_command() -> list[str]:
    """The ``stream-gateway`` executable of this interpreter's environment."""
    beside = Path(sys.executable).with_name("stream-gateway")
    found = str(beside) if beside.exists() else shutil.which("stream-gateway")
    if found is None:
        raise RuntimeError("stream-gateway is not installed in this environment (bash scripts/install.sh)")
    return [found]


async def prepare_model(model: str) -> Path:
    """The local directory of ``model``, as ``stream-gateway prepare-model`` prints it (built on first use)."""
    result = await anyio.run_process([*gateway_command(), "prepare-model", "--model", model])
    return Path(result.stdout.decode().strip().splitlines()[-1])


def free_port() -> int:
    """A port free now (bound to 0 and closed: another process could take it in between)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def running_gateway(
    *,
    model: str,
    data_dir: Path,
    log_path: Path,
    up_flags: Sequence[str],
    startup_timeout_s: float = 180.0,
    stop_timeout_s: float = 30.0,
) -> AsyncIterator[GatewayProcess]:
    """Run ``stream-gateway up --model <model>`` with ``up_flags`` until the block exits."""
    port = free_port()
    command = [
        *gateway_command(),
        "up",
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--nats-port", "0",
        "--nats-monitor-port", "0",
        "--data-dir", str(data_dir),
        *up_flags,
    ]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        # Its own session: a Ctrl-C in the terminal reaches this script only, which stops the users
        # and the trainer first and then the gateway (SIGINT below), in that order.
        process = await anyio.open_process(command, stdin=None, stdout=log, stderr=log, start_new_session=True)
        try:
            with anyio.fail_after(startup_timeout_s):
                nats_url = await _wait_ready(process, log_path, f"http://127.0.0.1:{port}")
            yield GatewayProcess(f"http://127.0.0.1:{port}", nats_url, data_dir / "batches", log_path, process)
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGINT)
                    with anyio.move_on_after(stop_timeout_s):
                        await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                await process.aclose()


async def _wait_ready(process: Process, log_path: Path, base_url: str) -> str:
    """Poll the log for the NATS URL and ``/health`` for status ok; the NATS URL."""
    nats_url: str | None = None
    log = anyio.Path(log_path)
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            if process.returncode is not None:
                tail = (await log.read_text(errors="replace"))[-3000:]
                raise RuntimeError(f"stream-gateway up exited with status {process.returncode}:\n{tail}")
            if nats_url is None:
                for line in (await log.read_text(errors="replace")).splitlines():
                    if match := _NATS_LINE.match(line):
                        nats_url = match[1]
            if nats_url is not None:
                try:
                    response = await http.get(f"{base_url}/health")
                    if response.status_code == 200 and response.json().get("status") == "ok":
                        return nats_url
                except httpx.TransportError:
                    pass  # not listening yet
            await anyio.sleep(0.2)
