"""``--workers N``: N gateway processes on one port, sharing sessions through NATS.

One Python process streams on one core; a host with more cores runs several. The supervisor
(this module, in the ``serve``/``up`` process) starts N ``stream-gateway serve`` children with
the same settings (passed as ``STREAM_GATEWAY_*`` environment variables), each binding the port
with ``SO_REUSEPORT`` so that the kernel spreads new connections over them. Each child has its
own event outbox (``<outbox>/w<i>``) and replica id (``<replica>-w<i>``). A child that dies is
started again (after a pause that grows while it keeps dying); stopping the supervisor (Ctrl-C,
SIGTERM) stops every child gracefully, each draining its events.

Conditions, checked before anything starts:

* an engine the processes can share: ``synthetic``, or ``vllm-http``/``sglang-http`` (inference
  servers every worker talks to). ``transformers`` and ``vllm`` hold the model in the process:
  N workers would load N models;
* shared sessions (``--nats-url`` and not ``--no-shared-sessions``): a connection may land on any
  worker, so every worker must be able to continue every session;
* a fixed port (not 0).

The workers sign thinking blocks (``stream_gateway.reasoning.ThinkingSigner``) with one key, so a
block one worker streamed is recognised by the worker its echo reaches: ``--reasoning-key-file``
when given, else a random key the supervisor writes to a private file for this run.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
from anyio.abc import Process

from stream_gateway._errors import WorkersRefused
from stream_gateway._settings import Settings

__all__ = ["check_workers", "listening_socket", "run_workers", "shared_signing_key"]

log = logging.getLogger(__name__)


def check_workers(settings: Settings) -> None:
    """Refuse ``--workers N > 1`` where it cannot work, with what to do instead."""
    if settings.workers <= 1:
        return
    from stream_gateway.engines.registry import ENGINES

    entry = ENGINES.get(settings.engine)
    if entry is None or not entry.shareable:
        raise WorkersRefused(
            f"--workers {settings.workers} needs an engine that several processes can share; the "
            f"{settings.engine} engine holds the model inside the process. Serve the model with vLLM or "
            "SGLang and use --engine vllm-http or sglang-http --upstream URL (every worker talks to the "
            "same servers), or --engine synthetic for load tests; or run one worker."
        )
    if settings.nats_url is None or not settings.shared_sessions:
        raise WorkersRefused(
            f"--workers {settings.workers} needs shared sessions: a client's next request may reach any "
            "worker. Add --nats-url (and leave shared sessions on), or use `stream-gateway up`, which runs NATS."
        )
    if settings.port == 0:
        raise WorkersRefused(f"--workers {settings.workers} needs a fixed --port (the workers share it).")


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A bound TCP socket for uvicorn; with ``reuse_port`` several processes can bind the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def worker_environment(settings: Settings, index: int) -> dict[str, str]:
    """The environment of worker ``index``: every setting as ``STREAM_GATEWAY_*``, adjusted per worker."""
    from stream_gateway.app import default_outbox_dir

    values = settings.model_dump(mode="json")
    outbox = Path(settings.outbox_dir) if settings.outbox_dir else default_outbox_dir(settings)
    replica = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    values |= {
        "workers": 1,
        "worker_index": index,
        "outbox_dir": str(outbox / f"w{index}"),
        "replica_id": f"{replica}-w{index}",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    for name, value in values.items():
        if value is None:
            continue
        env[f"STREAM_GATEWAY_{name.upper()}"] = (
            json.dumps(value) if isinstance(value, list | dict | bool) else str(value)
        )
    return env


async def run_workers(settings: Settings, say: Callable[[str], None]) -> None:
    """Run ``settings.workers`` gateway processes until cancelled; then stop them gracefully."""
    check_workers(settings)
    count = settings.workers
    say(f"starting {count} gateway workers on port {settings.port} (SO_REUSEPORT), sessions shared through NATS")
    running: dict[int, Process] = {}
    with shared_signing_key(settings) as settings:
        async with anyio.create_task_group() as tg:
            if settings.api_key_file is not None:
                tg.start_soon(_forward_reloads, running, say)
            for index in range(count):
                tg.start_soon(_keep_running, settings, index, say, running)


@contextmanager
def shared_signing_key(settings: Settings) -> Iterator[Settings]:
    """``settings`` with a ``reasoning_key_file`` every worker reads: the configured one, else a
    random key in a file only this user can read, removed when the workers have stopped."""
    if settings.reasoning_key_file is not None:
        yield settings
        return
    with tempfile.TemporaryDirectory(prefix="stream-gateway-") as folder:  # mode 0700
        path = Path(folder) / "reasoning.key"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(32))
        yield settings.model_copy(update={"reasoning_key_file": path})


async def _forward_reloads(running: dict[int, Process], say: Callable[[str], None]) -> None:
    """SIGHUP to the supervisor reaches every worker: each reloads the key file."""
    with anyio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            for process in running.values():
                process.send_signal(signal.SIGHUP)
            say(f"SIGHUP passed to {len(running)} workers: reloading the key file")


async def _keep_running(
    settings: Settings, index: int, say: Callable[[str], None], running: dict[int, Process]
) -> None:
    command = [sys.executable, "-m", "stream_gateway.cli", "serve"]
    env = worker_environment(settings, index)
    pause = 0.5
    while True:
        started = time.monotonic()
        process = await anyio.open_process(command, env=env, stdin=None, stdout=None, stderr=None)
        running[index] = process
        try:
            code = await process.wait()
        finally:
            running.pop(index, None)
            if process.returncode is None:  # we are being stopped: stop the worker, gracefully
                with anyio.CancelScope(shield=True):
                    process.send_signal(signal.SIGTERM)
                    with anyio.move_on_after(30):
                        await process.wait()
                    if process.returncode is None:
                        process.kill()
                        await process.wait()
        if time.monotonic() - started > 60:
            pause = 0.5  # it ran a good while: this is a new failure, not the same one again
        say(f"worker {index} exited with status {code}; starting it again in {pause:g} s")
        await anyio.sleep(pause)
        pause = min(pause * 2, 30.0)
