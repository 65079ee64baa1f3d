"""What a ``vllm-http`` gateway costs in front of an inference server at full speed, side by side in one run.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/remote_engine.py
    .venv/bin/python benchmarks/remote_engine.py --streams 1 16 --tokens 256 --repeats 3

Set-up, all real processes on this machine:

* upstream: ``stream-gateway serve --engine synthetic`` (no model: tokens as fast as the
  loop allows), which speaks vLLM's ``/v1/completions`` token-in protocol like a vLLM server.
  It coalesces the steps that queue up while its loop is busy, so it sends far fewer frames
  than tokens (~11 frames for 256 tokens): this measures the front at maximum throughput, not
  at one token per frame. For a vLLM-like upstream (one token per frame, paced per stream, the
  per-frame costs a front pays in production), see ``benchmarks/relay.py``.
* front: ``stream-gateway serve --engine vllm-http --upstream <upstream>``, the same tokenizer.
* load: ``streams`` concurrent streamed chat completions of ``tokens`` tokens each
  (``ignore_eos``, ``include_usage``), sent either **directly** to the upstream (its own chat
  endpoint: baseline) or **through** the front. An httpx client in this process counts tokens by
  each response's ``usage`` frame (never by frames) and frames apart; its CPU is reported too.

Reported per configuration (medians over ``repeats`` runs): streamed tokens/s, tokens per frame
the client received, CPU seconds per 1,000 tokens of each process (``/proc/<pid>/stat``), and
time to first token (request sent to first content frame, sequential single requests). The
ratios in the last lines: the front's tokens per CPU-second next to the upstream's serving the
same load directly, and the time to first token the extra hop adds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson

from stream_gateway.models import resolve_model

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _self_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start(args: list[str], port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "stream_gateway.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server {args} did not start")
        time.sleep(0.2)


async def _stream(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[int, int, float]:
    """One streamed request: tokens (from its usage frame), frames, and time to the first content frame."""
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "go"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": tokens, "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    first = 0.0
    frames = 0
    tail = b""  # the last bytes received: the usage frame comes last, before [DONE]
    async with client.stream("POST", url, json=body) as response:
        async for chunk in response.aiter_bytes():
            if not first and b'"content"' in chunk and b'"role"' not in chunk:
                first = time.perf_counter() - started
            frames += chunk.count(b"data: ")
            tail = (tail + chunk)[-4096:]
    at = tail.rfind(b'"usage":')
    if at < 0:
        raise SystemExit(f"a response from {url} ended without a usage frame")
    start = tail.rfind(b"data: ", 0, at) + 6
    usage = orjson.loads(tail[start : tail.find(b"\n\n", at)])["usage"]
    return int(usage["completion_tokens"]), frames, first


async def _run_load(url: str, streams: int, tokens: int) -> tuple[float, int, int]:
    """``streams`` concurrent requests: wall time, tokens (by usage) and frames."""
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, url, tokens) for _ in range(streams)))
        wall = time.perf_counter() - started
    return wall, sum(r[0] for r in results), sum(r[1] for r in results)


async def _load(url: str, streams: int, tokens: int) -> tuple[float, int]:
    """Wall time and tokens (counted by usage) of ``streams`` concurrent requests (``workers.py`` uses it too)."""
    wall, counted, _ = await _run_load(url, streams, tokens)
    return wall, counted


async def _ttft(url: str, samples: int) -> float:
    async with httpx.AsyncClient(timeout=60) as client:
        values = [(await _stream(client, url, 4))[2] for _ in range(samples)]
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = resolve_model("tiny")
    up_port, front_port = _free_port(), _free_port()
    upstream = _start(["--engine", "synthetic", "--model", tokenizer, "--default-max-tokens", "4096"], up_port)
    front = _start(["--engine", "vllm-http", "--model", tokenizer, "--served-model-name", "synthetic",
                    "--upstream", f"http://127.0.0.1:{up_port}", "--max-model-len", "32768"], front_port)  # fmt: skip
    targets = {"direct": f"http://127.0.0.1:{up_port}", "via vllm-http": f"http://127.0.0.1:{front_port}"}
    summary: dict[tuple[str, int], dict[str, float]] = {}
    try:
        print(
            f"{'route':<14}{'streams':>8}{'tok/s':>10}{'tok/frame':>10}{'upstream':>10}{'front':>10}{'client':>10}"
            "   CPU-s per 1k tokens (counted by usage)"
        )
        for streams in args.streams:
            for name, base in targets.items():
                runs = []
                for _ in range(args.repeats):
                    cpu0 = (_cpu(upstream.pid), _cpu(front.pid), _self_cpu())
                    url = base + "/v1/chat/completions"
                    wall, counted, frames = asyncio.run(_run_load(url, streams, args.tokens))
                    cpu1 = (_cpu(upstream.pid), _cpu(front.pid), _self_cpu())
                    k = counted / 1000
                    runs.append({"tps": counted / wall, "tpf": counted / max(frames - 3 * streams, 1),
                                 "up": (cpu1[0] - cpu0[0]) / k,
                                 "front": (cpu1[1] - cpu0[1]) / k, "client": (cpu1[2] - cpu0[2]) / k})  # fmt: skip
                med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                summary[(name, streams)] = med
                print(
                    f"{name:<14}{streams:>8}{med['tps']:>10.0f}{med['tpf']:>10.2f}{med['up']:>10.3f}"
                    f"{med['front']:>10.3f}{med['client']:>10.3f}"
                )
        ttft = {name: asyncio.run(_ttft(base + "/v1/chat/completions", 30)) for name, base in targets.items()}
        print()
        for streams in args.streams:
            direct, via = summary[("direct", streams)], summary[("via vllm-http", streams)]
            ratio = direct["up"] / via["front"]
            print(
                f"{streams:>3} streams: front tokens per CPU-s {1000 / via['front']:.0f} vs upstream serving "
                f"directly {1000 / direct['up']:.0f} (ratio {ratio:.2f}); throughput via/direct "
                f"{via['tps'] / direct['tps']:.2f}"
            )
        added = (ttft["via vllm-http"] - ttft["direct"]) * 1e3
        print(
            f"time to first token: direct {ttft['direct'] * 1e3:.1f} ms, "
            f"via vllm-http {ttft['via vllm-http'] * 1e3:.1f} ms (added {added:.1f} ms)"
        )
    finally:
        for process in (front, upstream):
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
