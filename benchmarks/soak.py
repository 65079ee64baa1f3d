"""A soak: 1,000 concurrent streams paced at 5 tokens/s each for a minute, capture on.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/soak.py
    .venv/bin/python benchmarks/soak.py --streams 1000 --rate 5 --seconds 60 --json soak.json

Set-up: an embedded ``nats-server``; one gateway on the synthetic engine paced at ``--rate``
tokens/s per request (``--synthetic-tokens-per-second``), capturing to NATS with shared sessions
(the defaults with ``--nats-url``). ``benchmarks/loadgen.py`` opens ``--streams`` connections,
their starts spread over ``--ramp-seconds``, each asking for ``rate x seconds`` tokens.

Reported: errors; offered and delivered tokens/s; the delivered fraction, the ideal stream-seconds
(tokens / rate) over the stream-seconds the client measured (1.0: no stream took longer than its
tokens needed at the offered rate); time to first token and the gap between frames (p50, p99,
max) at the client; the gateway's CPU seconds and its resident memory before, at its peak (sampled
every 0.5 s) and after; the events on the stream.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import nats
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, loadgen, rss_mb
from hot_path import start_gateway

from pipeline.embedded import EmbeddedNatsServer


def _peak_rss(pid: int, stop: threading.Event, peak: list[float]) -> None:
    while not stop.wait(0.5):
        peak[0] = max(peak[0], rss_mb(pid))


async def _events(url: str) -> int:
    client = await nats.connect(url)
    try:
        info = await client.jetstream().stream_info("SG_EVENTS")
        return int(info.state.messages)
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=5.0, help="tokens/s of each stream")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each stream")
    parser.add_argument("--ramp-seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokens = int(args.rate * args.seconds)

    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as nats_server:
        gateway = start_gateway(
            "capture on",
            ["--nats-url", nats_server.url, "--outbox-dir", str(Path(tmp) / "outbox"),
             "--synthetic-tokens-per-second", str(args.rate)],
        )  # fmt: skip
        pid = gateway.process.pid
        try:
            loadgen(gateway.url, gateway.model, 4, 4)  # warm-up
            rss_before, cpu_before = rss_mb(pid), cpu_s(pid)
            peak, stop = [rss_before], threading.Event()
            sampler = threading.Thread(target=_peak_rss, args=(pid, stop, peak), daemon=True)
            sampler.start()
            print(f"soak: {args.streams} streams x {tokens} tokens at {args.rate:g} tokens/s ...", file=sys.stderr)
            run = loadgen(
                gateway.url, gateway.model, args.streams, tokens, extra=["--ramp-seconds", str(args.ramp_seconds)]
            )
            stop.set()
            sampler.join()
            gateway_cpu = cpu_s(pid) - cpu_before
            rss_after = rss_mb(pid)
            events = asyncio.run(_events(nats_server.url))
        finally:
            gateway.process.terminate()
            gateway.process.wait(60)
    ideal = run["tokens"] / args.rate
    result: dict[str, Any] = {
        "streams": args.streams,
        "tokens_per_stream": tokens,
        "rate": args.rate,
        "errors": run["errors"],
        "error_samples": run["error_samples"],
        "responses": run["responses"],
        "offered_tokens_per_s": args.streams * args.rate,
        "delivered_tokens_per_s": run["tokens"] / (run["elapsed_s"] - args.ramp_seconds),
        "delivered_fraction": ideal / run["stream_seconds"] if run["stream_seconds"] else 0.0,
        "tokens": run["tokens"],
        "first_token": run["first_token"],
        "gap": run["gap"],
        "tokens_per_frame": run["tokens_per_frame"],
        "gateway_cpu_s": gateway_cpu,
        "gateway_cpu_per_1k": gateway_cpu / max(run["tokens"], 1) * 1000,
        "client_cpu_s": run["client_cpu_s"],
        "rss_mb": {"before": rss_before, "peak": peak[0], "after": rss_after},
        "events_on_stream": events,
    }
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
