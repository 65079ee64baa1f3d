"""Running a real gateway for tests: uvicorn on a socket bound to a free loopback port.

The server runs in a thread with its own event loop, as httpx's tests do, so tests talk to it
over a real TCP socket with real clients.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from stream_gateway import Settings, create_app
from stream_gateway.engines import Engine
from stream_gateway.engines.scripted import DEFAULT_SCRIPT, Script


@dataclass(frozen=True)
class RunningGateway:
    """Where a test gateway listens, and the engine behind it (for its tokenizer only)."""

    base_url: str
    engine: Engine

    def health(self) -> dict[str, object]:
        """``GET /health`` over the socket."""
        response = httpx.get(self.base_url + "/health", timeout=10)
        response.raise_for_status()
        result: dict[str, object] = response.json()
        return result


@contextmanager
def run_gateway(
    engine: Engine, settings: Settings, *, startup_timeout: float = 120.0, send_buffer: int | None = None
) -> Iterator[RunningGateway]:
    """Serve ``engine`` on 127.0.0.1:<free port> until the block exits (``send_buffer``: see :func:`serve_app`)."""
    with serve_app(create_app(engine, settings), startup_timeout=startup_timeout, send_buffer=send_buffer) as base_url:
        yield RunningGateway(base_url, engine)


@contextmanager
def serve_app(app: Any, *, startup_timeout: float = 120.0, send_buffer: int | None = None) -> Iterator[str]:
    """Serve an ASGI ``app`` on 127.0.0.1:<free port> until the block exits; yields its base URL.

    ``send_buffer``: the kernel send buffer of every connection, in bytes, fixed. Unset, Linux grows a
    loopback connection's to megabytes as it sends, so a server's writes wait only for a very slow
    reader of a very long response.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:  # accepted connections inherit it; a size that was set is never grown
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def free_port() -> int:
    """A loopback port nothing listens on (for a child process to bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(process: subprocess.Popen[str], port: int, timeout: float = 120.0, *, log: Path | None = None) -> None:
    """Until ``GET /health`` of a gateway process answers 200; fail with its output (its stdout
    pipe, or ``log`` where it writes) if it dies first."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            output = log.read_text()[-3000:] if log else (process.stdout.read() if process.stdout else "")
            raise AssertionError(f"the gateway exited with {process.returncode}: {output}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the gateway did not become healthy"
        time.sleep(0.2)


# A rule ahead of the default script's for agents that put a message of their own after the tool
# result (OpenClaw moves its internal context last): once any tool result is in the prompt, answer,
# so the agent's loop ends after one call instead of at its time limit.
ANSWER_AFTER_ANY_TOOL_RESULT = {
    "when": {"matches": "<tool_response>"},
    "think": "The result is in, now answer.",
    "say": "Done: I read the file.",
}


def script_file(path: Path, *first: dict[str, Any]) -> Path:
    """The default script with the rules ``first`` ahead of its own, as the JSON file ``path``
    (for ``script=path``; docs/engines.md#scripted)."""
    rules = [*first, *DEFAULT_SCRIPT.model_dump()["rules"]]
    path.write_text(Script.model_validate({"rules": rules}).model_dump_json())
    return path


def scripted_settings(model: Path | str, served_model_name: str = "tiny-agent", **options: Any) -> Settings:
    """Settings of a gateway on the scripted engine: tiny-agent's repertoire (engines/_script.py's
    ``DEFAULT_SCRIPT``) on ``model``, unless ``script=`` names a script file."""
    return Settings(model=str(model), served_model_name=served_model_name, engine="scripted", **options)
