"""Ctrl-C (SIGINT) with 8 streams in flight (issue 43): the gateway stops taking requests, lets
streams finish for ``--shutdown-grace-seconds``, then ends each one still running with an error
frame and ``[DONE]``; every turn is recorded (completed, or aborted with reason ``shutdown``) and
reaches NATS before the process exits. A real gateway process, a real nats-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson

from pipeline.embedded import EmbeddedNatsServer

from ..support.capture import of_session, read_stream
from ..support.servers import free_port, wait_healthy


def _stream(port: int, session: str, tokens: int, first: threading.Event, frames: dict[str, list[bytes]]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    seen: list[bytes] = []
    frames[session] = seen
    try:
        url = f"http://127.0.0.1:{port}/sessions/{session}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen.append(line[6:].encode())
                    first.set()
    except httpx.HTTPError as exc:  # a broken stream: the assertions below name it
        seen.append(f"broken: {exc!r}".encode())
    first.set()


def test_sigint_ends_every_stream_with_a_frame_and_records_every_turn(
    nats_server: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    port = free_port()
    # 20 tokens/s: the short answers (10 tokens) end within the 1.5 s grace, the long ones (400) cannot.
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "synthetic", "--model",
               str(tiny_model_path), "--served-model-name", "m", "--port", str(port), "--log-level", "warning",
               "--nats-url", nats_server.url, "--outbox-dir", str(tmp_path / "outbox"), "--no-shared-sessions",
               "--synthetic-tokens-per-second", "20", "--shutdown-grace-seconds", "1.5"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    log = tmp_path / "gateway.log"
    with log.open("a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    frames: dict[str, list[bytes]] = {}
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    sessions = {f"short{i}-{tag}": 10 for i in range(4)} | {f"long{i}-{tag}": 400 for i in range(4)}
    try:
        wait_healthy(process, port, log=log)
        threads = []
        for session, tokens in sessions.items():
            first = threading.Event()
            thread = threading.Thread(target=_stream, args=(port, session, tokens, first, frames))
            thread.start()
            assert first.wait(30), f"{session} never started"
            threads.append(thread)
        process.send_signal(signal.SIGINT)
        for thread in threads:
            thread.join(60)
        assert process.wait(60) == 0, log.read_text()[-3000:]
    finally:
        process.kill()
        process.wait(30)
    for session, seen in frames.items():
        assert seen and seen[-1] == b"[DONE]", (session, seen[-3:])
        last = orjson.loads(seen[-2])
        if session.startswith("short"):  # within the grace: the whole answer
            assert last["choices"][0]["finish_reason"] == "length", (session, last)
        else:
            assert last["error"]["code"] == "shutting_down", (session, last)
    events = [event for _, event in read_stream(nats_server.url)]
    for session in sessions:
        ends = [e for e in of_session(events, session) if e.kind in ("turn.completed", "turn.aborted")]
        assert len(ends) == 1, (session, [e.kind for e in of_session(events, session)])
        if session.startswith("long"):
            assert ends[0].kind == "turn.aborted" and ends[0].reason == "shutdown", ends[0]
        else:
            assert ends[0].kind == "turn.completed"
