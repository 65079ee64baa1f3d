"""``stream-gateway serve --workers N``: N processes on one port sharing sessions through NATS."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway import Settings
from stream_gateway._workers import shared_signing_key, worker_environment
from stream_gateway.cli import settings_from_args
from stream_gateway.reasoning import ThinkingSigner

from ..support.servers import free_port, wait_healthy


def _command(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "stream_gateway.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
            "--port", str(port), "--log-level", "warning", *extra]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}


def test_two_workers_share_the_port_and_the_sessions(tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "workers.log"
    with EmbeddedNatsServer() as nats_server, log.open("w") as out:
        command = _command(tiny_model_path, port, "--engine", "synthetic", "--workers", "2",
                           "--nats-url", nats_server.url, "--outbox-dir", str(tmp_path / "outbox"))  # fmt: skip
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env(), text=True)
        try:
            wait_healthy(process, port, log=log)
            base = f"http://127.0.0.1:{port}"
            # New connections are spread over both workers by the kernel.
            replicas = set()
            for _ in range(40):
                replicas.add(httpx.get(f"{base}/health", timeout=10).json()["replica"])
                if len(replicas) == 2:
                    break
            assert len(replicas) == 2, replicas
            # A conversation continues whichever worker each of its requests reaches.
            messages = [{"role": "user", "content": "hello"}]
            sessions = []
            for turn in range(6):
                reply = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                                   json={"model": "tiny", "messages": messages, "max_tokens": 4})  # fmt: skip
                assert reply.status_code == 200, reply.text
                sessions.append(reply.headers["x-session-id"])
                messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
            assert len(set(sessions)) == 1, sessions
            turns = httpx.get(f"{base}/sessions/{sessions[0]}", timeout=10).json()["turns"]
            assert len(turns) == 6
            assert sum(t["parent_id"] is None for t in turns) == 1
            assert all(t["reused_prompt_tokens"] > 0 for t in turns if t["parent_id"] is not None)
        finally:
            process.terminate()
            assert process.wait(timeout=60) == 0, log.read_text()


def test_workers_with_an_in_process_engine_or_without_nats_are_refused(tiny_model_path: Path) -> None:
    port = free_port()
    in_process = subprocess.run(_command(tiny_model_path, port, "--workers", "2", "--nats-url", "nats://127.0.0.1:1"),
                                capture_output=True, text=True, env=_env(), timeout=120)  # fmt: skip
    assert in_process.returncode == 2
    assert "--engine vllm-http or sglang-http" in in_process.stderr and "holds the model" in in_process.stderr
    no_nats = subprocess.run(_command(tiny_model_path, port, "--workers", "2", "--engine", "synthetic"),
                             capture_output=True, text=True, env=_env(), timeout=120)  # fmt: skip
    assert no_nats.returncode == 2 and "needs shared sessions" in no_nats.stderr


def test_sighup_to_the_supervisor_reloads_every_workers_keys(tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "workers.log"
    keys = tmp_path / "keys.txt"
    keys.write_text("k-old team\n")
    with EmbeddedNatsServer() as nats_server, log.open("w") as out:
        outbox = str(tmp_path / "outbox")
        command = _command(tiny_model_path, port, "--engine", "synthetic", "--workers", "2", "--api-key-file",
                           str(keys), "--nats-url", nats_server.url, "--outbox-dir", outbox)  # fmt: skip
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env(), text=True)
        try:
            wait_healthy(process, port, log=log)
            base = f"http://127.0.0.1:{port}"

            def statuses(key: str) -> dict[str, int]:
                """The answer to ``key`` from each worker (new connections spread over both)."""
                seen: dict[str, int] = {}
                for _ in range(60):
                    with httpx.Client(headers={"authorization": f"Bearer {key}"}, timeout=10) as client:
                        replica = client.get(f"{base}/health").json()["replica"]
                        seen[replica] = client.get(f"{base}/v1/models").status_code
                    if len(seen) == 2:
                        break
                return seen

            assert set(statuses("k-new").values()) == {401}
            keys.write_text("k-new team\n")
            process.send_signal(signal.SIGHUP)
            for _ in range(50):  # the workers reload as the signal reaches them
                answers = statuses("k-new")
                if set(answers.values()) == {200}:
                    break
                time.sleep(0.1)
            assert len(answers) == 2 and set(answers.values()) == {200}, answers
            assert set(statuses("k-old").values()) == {401}
        finally:
            process.terminate()
            assert process.wait(timeout=60) == 0, log.read_text()


def test_every_setting_reaches_the_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The supervisor hands its settings on as ``STREAM_GATEWAY_*`` variables: a worker reads the same ones."""
    settings = Settings.model_validate(
        {
            "engine": "synthetic",
            "served_model_name": "tiny",
            "api_keys": ("k1", "k2"),
            "model_cache_dir": tmp_path / "models",
            "live_deltas": False,
            "close_sessions_on_shutdown": True,
            "session_idle_seconds": 60.5,
            "max_n": 3,
            "kv_cache_on_update": "keep",
            "nats_url": "nats://127.0.0.1:4222",
            "workers": 2,
            "outbox_dir": tmp_path / "outbox",
            "replica_id": "r",
        }
    )
    environment = worker_environment(settings, 1)
    for name in os.environ:
        if name.startswith("STREAM_GATEWAY_"):
            monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    worker = settings_from_args(argparse.Namespace())  # no flags: the environment alone
    expected = {"workers": 1, "worker_index": 1, "outbox_dir": tmp_path / "outbox" / "w1", "replica_id": "r-w1"}
    assert worker == settings.model_copy(update=expected)


def test_workers_sign_thinking_with_one_key(tmp_path: Path) -> None:
    """A thinking block one worker signed is recognised by another: one key for all of them."""
    settings = Settings.model_validate(
        {"engine": "synthetic", "nats_url": "nats://127.0.0.1:4222", "workers": 2, "port": 8123}
    )
    with shared_signing_key(settings) as shared:
        path = shared.reasoning_key_file
        assert path is not None and path.stat().st_mode & 0o077 == 0  # only this user reads it
        keys = {worker_environment(shared, i)["STREAM_GATEWAY_REASONING_KEY_FILE"] for i in (0, 1)}
        assert keys == {str(path)}
        signed = ThinkingSigner.from_file(keys.pop()).sign("resp_1", "I should read it.")
        assert ThinkingSigner.from_file(path).check(signed, "I should read it.") == "ours"
        assert ThinkingSigner.from_file(None).check(signed, "I should read it.") == "modified"  # another key
    assert not path.exists()  # removed with the workers
    configured = tmp_path / "key"
    configured.write_text("a deployment's key\n")
    with shared_signing_key(settings.model_copy(update={"reasoning_key_file": configured})) as given:
        assert given.reasoning_key_file == configured
