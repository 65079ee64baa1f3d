"""``--workers 2`` next to one worker, side by side in one run: streamed tokens/s and CPU per token.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/workers.py
    .venv/bin/python benchmarks/workers.py --streams 16 64 --tokens 256 --repeats 3

Set-up, all real processes on this machine: one embedded ``nats-server``; two gateways on the
synthetic engine (tokens as fast as the loop allows) capturing to it with shared sessions, one
with ``--workers 1`` and one with ``--workers 2`` (a supervisor and two worker processes on one
port). Load: ``streams`` concurrent streamed chat completions of ``tokens`` tokens each from a
raw httpx client in this process, each a new conversation (so each ends with a shared-session
write: a record and an index entry in the KV bucket). Runs alternate between the two gateways.

Reported (medians over ``repeats``): tokens/s, and CPU seconds per 1,000 streamed tokens of the
gateway processes (workers summed), the client and nats-server, from ``/proc``. The machine has
two cores and the client shares them: the ratio is what this machine can show, not what two free
cores would give.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from remote_engine import _cpu, _free_port, _load, _self_cpu

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.models import resolve_model


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (the workers of a supervisor)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return _cpu(pid) + sum(_cpu(int(c)) for c in children)


def _start(workers: int, port: int, nats_url: str, outbox: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "synthetic",
               "--model", resolve_model("tiny"), "--port", str(port), "--log-level", "warning",
               "--workers", str(workers), "--nats-url", nats_url, "--outbox-dir", str(outbox),
               "--default-max-tokens", "4096", "--no-live-deltas"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    while len(seen) < workers:  # every worker answers (new connections reach either)
        try:
            seen.add(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["replica"])
        except (httpx.TransportError, ValueError):
            time.sleep(0.2)
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gateway with {workers} workers did not start")
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import tempfile

    with EmbeddedNatsServer() as nats_server, tempfile.TemporaryDirectory() as tmp:
        nats_pid = nats_server.pid
        assert nats_pid is not None
        gateways = {n: _start(n, _free_port(), nats_server.url, Path(tmp) / f"outbox{n}") for n in (1, 2)}
        ports = {n: int(p.args[p.args.index("--port") + 1]) for n, p in gateways.items()}  # type: ignore[union-attr]
        try:
            print(f"{'workers':>8}{'streams':>8}{'tok/s':>10}{'gateway':>10}{'client':>10}{'nats':>10}   CPU-s per 1k")
            summary = {}
            for streams in args.streams:
                runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
                for _ in range(args.repeats):
                    for n, process in gateways.items():
                        url = f"http://127.0.0.1:{ports[n]}/v1/chat/completions"
                        before = (_tree_cpu(process.pid), _self_cpu(), _cpu(nats_pid))
                        wall, frames = asyncio.run(_load(url, streams, args.tokens))
                        after = (_tree_cpu(process.pid), _self_cpu(), _cpu(nats_pid))
                        k = frames / 1000
                        spent = [(a - b) / k for a, b in zip(after, before, strict=True)]
                        runs[n].append(
                            {"tps": frames / wall, "gateway": spent[0], "client": spent[1], "nats": spent[2]}
                        )
                for n in (1, 2):
                    med = {key: statistics.median(r[key] for r in runs[n]) for key in runs[n][0]}
                    summary[(n, streams)] = med
                    print(f"{n:>8}{streams:>8}{med['tps']:>10.0f}{med['gateway']:>10.3f}"
                          f"{med['client']:>10.3f}{med['nats']:>10.3f}")  # fmt: skip
            print()
            for streams in args.streams:
                one, two = summary[(1, streams)], summary[(2, streams)]
                print(f"{streams:>3} streams: tokens/s 2 workers / 1 worker {two['tps'] / one['tps']:.2f}; "
                      f"gateway CPU per token 2 / 1 {two['gateway'] / one['gateway']:.2f}")  # fmt: skip
        finally:
            for process in gateways.values():
                process.terminate()
                process.wait(timeout=60)


if __name__ == "__main__":
    main()
