"""Run LiteLLM's proxy as a bare relay in front of an upstream, for the gateway-vs-LiteLLM benchmark.

LiteLLM is not a dependency of this project: it lives in its own virtual environment, ``benchmarks/.venv-litellm``
(``bash benchmarks/litellm_env.sh`` makes it), and this module only writes its config and runs its ``litellm``
command from there as a subprocess, with a clean environment. Nothing here imports litellm.

Read for LiteLLM 1.106.2 (what ``litellm[proxy]==1.106.*`` resolves to here; see ``litellm_env.sh``): the settings
below come from that version's source (``litellm/proxy/proxy_server.py``, ``proxy/proxy_cli.py``,
``litellm_core_utils/get_model_cost_map.py``, ``anthropic_beta_headers_manager.py``, ``proxy/_types.py``).

Use::

    config = write_config(Path(tmp) / "litellm.yaml", "http://127.0.0.1:9000", "fake-model")
    proc = start_litellm(config, port=4000, workers=1)
    try:
        ...  # POST http://127.0.0.1:4000/v1/chat/completions with model "fake-model"
    finally:
        stop_litellm(proc)

Smoke check (fake upstream + LiteLLM + one streamed request of 32 tokens through it)::

    .venv/bin/python benchmarks/litellm_proxy.py
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _procs import free_port

VENV = Path(__file__).resolve().parent / ".venv-litellm"
LITELLM_BIN = VENV / "bin" / "litellm"
HEALTH_PATH = "/health/liveliness"  # LiteLLM's historical spelling; 1.106 also serves /health/liveness

# Environment of the proxy process. Only these variables (plus PATH, HOME, LANG) are passed: no proxy variables, no
# API keys, no DATABASE_URL (so no database: LiteLLM runs without Prisma and its spend tracking).
LITELLM_ENV: dict[str, str] = {
    # Use the cost map bundled in the wheel: otherwise `import litellm` fetches model_prices_and_context_window.json
    # from raw.githubusercontent.com (seen here: DNS look-ups of that host from the proxy process, which fail).
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    # The same switch for the other remote JSON files 1.106 can fetch from raw.githubusercontent.com or its site
    # (Anthropic beta headers, blog posts for the UI, policy templates, auto-router presets): bundled copies only.
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    # Telemetry: the --telemetry flag is a deprecated no-op in 1.106; nothing else to turn off.
    # No admin UI and no OpenAPI docs pages: less start-up work, nothing served that a relay does not need.
    "DISABLE_ADMIN_UI": "True",
    "NO_DOCS": "True",
    "NO_REDOC": "True",
    # Logging: errors only. Without it uvicorn runs at INFO, with an access-log line per request.
    "LITELLM_LOG": "ERROR",
    # No Hugging Face Hub downloads of tokenizers (LiteLLM's token counter loads some with from_pretrained).
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PYTHONUNBUFFERED": "1",
}


def write_config(
    path: str | os.PathLike[str],
    upstream_url: str,
    model_name: str,
    *,
    master_key: str | None = None,
    disable_streaming_logging: bool = True,
) -> Path:
    """Write a LiteLLM proxy config routing ``model_name`` to ``openai/<model_name>`` at ``upstream_url + "/v1"``.

    Everything that costs per request and is not relaying is off: no database (no ``database_url``), no spend logs
    or spend updates, no error logs, no callbacks, no cache, no retries, no background health checks, no message
    logging. ``disable_streaming_logging`` also skips LiteLLM's end-of-stream success handler (it assembles the
    streamed chunks for the logging callbacks, of which there are none here; LiteLLM calls the switch "not
    recommended" because it turns off spend tracking of streams). The file is JSON, which is YAML. Returns ``path``.

    ``master_key``: ``None`` runs the proxy without authentication, as our gateway runs with no ``api_keys``; 1.106
    refuses to start without a master key unless ``dangerously_permit_weak_or_unset_master_key`` is set, which is
    what ``None`` writes. A key (``sk-`` and long, not the docs' ``sk-1234``) makes clients send
    ``Authorization: Bearer <key>``; without a database LiteLLM checks it against the master key only.
    """
    general_settings: dict[str, object] = {
        "disable_spend_logs": True,
        "disable_spend_updates": True,
        "disable_error_logs": True,
        "disable_reset_budget": True,
        "disable_prisma_schema_update": True,
        "background_health_checks": False,
        "store_model_in_db": False,
    }
    if master_key is None:
        general_settings["dangerously_permit_weak_or_unset_master_key"] = True
    else:
        general_settings["master_key"] = master_key
    config = {
        "model_list": [
            {
                "model_name": model_name,
                "litellm_params": {
                    "model": f"openai/{model_name}",
                    "api_base": upstream_url.rstrip("/") + "/v1",
                    "api_key": "sk-fake-upstream",  # dummy: the fake upstream does not check it
                },
            }
        ],
        "litellm_settings": {
            "set_verbose": False,
            "json_logs": False,
            "callbacks": [],
            "success_callback": [],
            "failure_callback": [],
            "service_callback": [],
            "cache": False,
            "num_retries": 0,
            "request_timeout": 600,
            "turn_off_message_logging": True,
            "disable_streaming_logging": disable_streaming_logging,
        },
        "router_settings": {"num_retries": 0, "enable_pre_call_checks": False},
        "general_settings": general_settings,
    }
    out = Path(path)
    out.write_text(json.dumps(config, indent=2) + "\n")
    return out


def _proxy_env() -> dict[str, str]:
    """A clean environment for the proxy: the venv's bin first on PATH, nothing inherited but HOME and LANG."""
    env = {
        "PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "VIRTUAL_ENV": str(VENV),
    }
    env.update(LITELLM_ENV)
    return env


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", HEALTH_PATH)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def start_litellm(
    config_path: str | os.PathLike[str],
    port: int,
    workers: int = 1,
    *,
    timeout: float = 180.0,
    log_path: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``litellm --config config_path`` on ``127.0.0.1:port`` from ``benchmarks/.venv-litellm``.

    Waits until ``GET /health/liveliness`` answers 200 and, with several workers, until they have all settled (the
    first one ready answers while the others still load). The process leads its own session, so that
    :func:`stop_litellm` ends its workers too and :func:`session_pids` finds them (to measure their CPU). Its stdout
    and stderr go to ``log_path`` (default: ``<config>.log`` beside the config), never to a pipe that could fill up
    during a benchmark. Raises ``RuntimeError`` with the log's tail if it exits or does not answer within ``timeout``
    seconds, and ``FileNotFoundError`` when the venv is missing.
    """
    if not LITELLM_BIN.exists():
        raise FileNotFoundError(f"{LITELLM_BIN} is missing: run `bash benchmarks/litellm_env.sh` first")
    config = Path(config_path).resolve()
    log = Path(log_path) if log_path is not None else config.with_name(config.name + ".log")
    command = [
        str(LITELLM_BIN),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        str(workers),
    ]
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            command,
            env=_proxy_env(),
            cwd=config.parent,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"litellm exited with code {proc.returncode} before answering {HEALTH_PATH} "
                f"(command: {' '.join(command)}); last lines of {log}:\n{_tail(log)}"
            )
        if _healthy(port):
            if workers > 1:
                _wait_settled(proc, deadline)
            return proc
        if time.monotonic() > deadline:
            stop_litellm(proc)
            raise RuntimeError(
                f"litellm did not answer {HEALTH_PATH} on port {port} within {timeout:.0f} s "
                f"(command: {' '.join(command)}); last lines of {log}:\n{_tail(log)}"
            )
        time.sleep(0.2)


def session_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """The processes of a proxy started by :func:`start_litellm`: its leader and every worker (its session's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == proc.pid:  # fields[3] is the session id (fields[2] the process group)
            pids.append(int(entry.name))
    return sorted(pids)


def _cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / ticks


def _wait_settled(proc: subprocess.Popen[bytes], deadline: float, window: float = 0.5) -> None:
    """Wait until the proxy's processes use under 10% of a core over ``window`` s (every worker done loading).

    With several workers the first one ready answers the health check while the others still import LiteLLM and load
    the config, which takes seconds of CPU each; they accept no connection until then. Gives up at ``deadline``.
    """
    before = _cpu_seconds(session_pids(proc))
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(window)
        after = _cpu_seconds(session_pids(proc))
        if after - before < 0.1 * window:
            return
        before = after


def stop_litellm(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Stop a proxy started by :func:`start_litellm` and its workers: SIGTERM to its session, SIGKILL past timeout."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):  # the workers, if any outlived the leader, and a leader past timeout
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def smoke(max_tokens: int = 32, workers: int = 1) -> None:
    """Fake upstream + LiteLLM + one streamed request through LiteLLM; checks ``max_tokens`` content chunks + [DONE]."""
    import sys
    import tempfile

    import httpx

    model = "fake-model"
    upstream_port, proxy_port = free_port(), free_port()
    fake = Path(__file__).resolve().parent / "fake_upstream.py"
    upstream = subprocess.Popen(
        [sys.executable, str(fake), "--port", str(upstream_port)], stdout=subprocess.PIPE, text=True
    )
    proxy: subprocess.Popen[bytes] | None = None
    try:
        assert upstream.stdout is not None
        if upstream.stdout.readline().strip() != "ready":
            raise RuntimeError("fake upstream did not start")
        with tempfile.TemporaryDirectory() as tmp:
            config = write_config(Path(tmp) / "litellm.yaml", f"http://127.0.0.1:{upstream_port}", model)
            started = time.monotonic()
            proxy = start_litellm(config, proxy_port, workers)
            print(
                f"litellm answered {HEALTH_PATH} after {time.monotonic() - started:.1f} s, pids {session_pids(proxy)}"
            )
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens,
                "stream": True,
            }
            content, done, frames = 0, False, 0
            started = time.monotonic()
            with httpx.stream("POST", f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    frames += 1
                    if line == "data: [DONE]":
                        done = True
                        continue
                    choices = json.loads(line[6:]).get("choices") or []
                    if choices and choices[0].get("delta", {}).get("content"):
                        content += 1
            elapsed = time.monotonic() - started
            print(f"{frames} frames, {content} content chunks, [DONE]: {done}, {elapsed * 1000:.0f} ms")
            if content != max_tokens or not done:
                raise SystemExit(f"FAIL: expected {max_tokens} content chunks and [DONE]")
            print("OK")
            stop_litellm(proxy)
            proxy = None
    finally:
        if proxy is not None:
            stop_litellm(proxy)
        upstream.terminate()
        upstream.wait(10)


if __name__ == "__main__":
    smoke()
