"""Oversized requests: what refusing them costs the gateway, in time, CPU and memory.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/oversized.py
    .venv/bin/python benchmarks/oversized.py --engine transformers --model tiny --count 20 --mb 50

One gateway process (default: the synthetic engine on the tiny model's tokenizer, default limits:
8 MiB bodies). Sent one after the other, ``--count`` of each:

* ``50 MB, Content-Length``: refused with 413 before a byte of the body is read;
* ``50 MB, chunked``: no Content-Length, refused once 8 MiB have been read;
* ``7 MB prompt``: under the body limit, but far more than the context holds: refused from the
  tokens of a prefix (``context_length_exceeded``) instead of rendering and tokenizing it all.

Reported per kind: status codes, median seconds per request as the client saw it, gateway CPU
seconds per request, and the gateway's RSS before, at its peak and after, next to one ordinary
request before and after (it must still be served).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, free_port, rss_mb, wait_http

from stream_gateway.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="synthetic")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--mb", type=int, default=50, help="size of the oversized bodies")
    args = parser.parse_args()

    port = free_port()
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", args.engine,
               "--model", resolve_model(args.model), "--served-model-name", "m", "--port", str(port),
               "--log-level", "warning", "--max-model-len", "4096"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", process)
        ordinary = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(timeout=300) as client:
            assert client.post(url + "/v1/chat/completions", json=ordinary).status_code == 200
            baseline = rss_mb(process.pid)
            big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (args.mb << 20)}]})
            prompt = orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hello world " * ((7 << 20) // 12)}]}
            )

            def chunked() -> Iterator[bytes]:
                for start in range(0, len(big), 1 << 20):
                    yield big[start : start + (1 << 20)]

            kinds = {
                f"{args.mb} MB, Content-Length": lambda: client.post(url + "/v1/chat/completions", content=big),
                f"{args.mb} MB, chunked": lambda: client.post(url + "/v1/chat/completions", content=chunked()),
                "7 MB prompt": lambda: client.post(url + "/v1/chat/completions", content=prompt),
            }
            peak = baseline
            print(f"gateway RSS at start (after one request): {baseline:.0f} MiB", file=sys.stderr)
            print(f"{'kind':24} {'statuses':>16} {'s/request':>10} {'CPU-s/request':>14} {'RSS after MiB':>14}")
            for name, send in kinds.items():
                statuses: dict[int, int] = {}
                seconds = []
                before = cpu_s(process.pid)
                for _ in range(args.count):
                    started = time.perf_counter()
                    try:
                        status = send().status_code
                    except httpx.HTTPError:  # the server may close the connection after its 413
                        status = -1
                    seconds.append(time.perf_counter() - started)
                    statuses[status] = statuses.get(status, 0) + 1
                    peak = max(peak, rss_mb(process.pid))
                cpu = (cpu_s(process.pid) - before) / args.count
                shown = ", ".join(f"{k}x{v}" for k, v in sorted(statuses.items()))
                print(
                    f"{name:24} {shown:>16} {statistics.median(seconds):10.3f} {cpu:14.3f} {rss_mb(process.pid):14.0f}"
                )
            after = client.post(url + "/v1/chat/completions", json=ordinary).status_code
        print(f"\nRSS: {baseline:.0f} MiB before, {peak:.0f} MiB peak, {rss_mb(process.pid):.0f} MiB after; "
              f"an ordinary request afterwards: {after}")  # fmt: skip
    finally:
        process.terminate()
        process.wait(30)


if __name__ == "__main__":
    main()
