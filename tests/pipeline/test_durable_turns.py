"""No completed turn lost to a crash: a streamed answer ends ([DONE]) only once its turn's events
are stored, so a gateway SIGKILLed the moment a client has its answer still delivers the turn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from pipeline.embedded import EmbeddedNatsServer

from ..support.capture import of_session, read_stream
from ..support.servers import free_port, wait_healthy


def _start(model: Path, nats_url: str, workdir: Path, log: Path) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    # Synthetic engine (starts fast); no shared sessions, so nothing but the durable wait holds
    # the final chunk back.
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "synthetic", "--model", str(model),
               "--served-model-name", "m", "--port", str(port), "--log-level", "warning", "--nats-url", nats_url,
               "--outbox-dir", str(workdir / "outbox"), "--no-shared-sessions"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    with log.open("a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    wait_healthy(process, port, log=log)
    return process, port


def test_a_gateway_killed_right_after_an_answer_keeps_the_turn(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    sessions = []
    for attempt in range(3):
        process, port = _start(tiny_model_path, nats_server.url, tmp_path, tmp_path / "gateway.log")
        session = f"durable{attempt}-{os.getpid()}"
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 8, "stream": True}
        try:
            with httpx.stream(
                "POST", f"http://127.0.0.1:{port}/sessions/{session}/v1/chat/completions", json=body, timeout=30
            ) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        process.send_signal(signal.SIGKILL)  # the client has its whole answer now
                        break
        finally:
            process.kill()
            process.wait(30)
        sessions.append(session)
    events = [event for _, event in read_stream(nats_server.url)]
    for session in sessions:
        kinds = [event.kind for event in of_session(events, session)]
        assert "turn.completed" in kinds, (session, kinds)
