"""What recording routed experts costs: CPU and NATS bytes per token, routes on and off, side by side in one run.

Run (from the repository root, after ``bash scripts/install.sh``; ``tiny-moe`` is built on first use)::

    .venv/bin/python benchmarks/moe_routes.py
    .venv/bin/python benchmarks/moe_routes.py --streams 1 16 --tokens 128 --repeats 5 --json moe.json

Set-up, all real processes on this machine: an embedded ``nats-server`` (JetStream, temp store);
two gateways serving the built-in ``tiny-moe`` (a 3-layer Qwen3-MoE, 8 experts, top-2) on the
``transformers`` engine, both capturing to that server (``--nats-url``, an outbox directory each):
routes on (the default: the engine's router hooks record every position's experts, and each
``turn.completed`` carries them as ``routed_experts``, base64) and routes off
(``--no-routed-experts``: nothing attached, nothing recorded, nothing sent).

Load: ``benchmarks/loadgen.py`` in a process of its own, ``streams`` concurrent keep-alive
connections, each sending streamed chat requests of ``tokens`` tokens (``ignore_eos``,
``include_usage``) one after the other, ``--tokens-per-run`` tokens in all. Configurations
alternate within every repeat, so drift hits both alike. After each run the benchmark waits until
the gateway has nothing pending for NATS and the events stream has stopped growing, so every
event of the run is counted in that run, and nothing of it in the next.

Reported per configuration and concurrency (medians over ``repeats``): tokens/s; CPU seconds per
1,000 streamed tokens of the gateway process (``/proc``; it runs the model too) and of
nats-server; bytes per streamed token that landed on NATS: the events stream (``state.bytes``
before and after each run, JetStream's stored size, subjects and headers included), the payload
object store (events over the max payload go there whole; none do here), and the key-value
buckets (the shared session records). The summary gives routes on / off for CPU and bytes per
token, as ratios of the medians and as medians of each repeat's pair, and the routes' expected
size: ``layers * top_k`` bytes per position raw (uint8 ids up to 256 experts), 4/3 of that in
base64, for every position a turn ran first (prompt + output - 1), next to what one recorded
``turn.completed`` actually held.

The model's forward pass dominates the gateway's CPU here (the toy model is small, but the
per-step torch overhead is not), so the absolute CPU figures are about torch on this machine; the
ratio against routes off, measured beside it, is the result. nats-server's CPU is a few 10 ms
ticks per run at the default budget, so its ratio is tick resolution rather than signal (raise
``--tokens-per-run`` to resolve it); bytes per token are exact and the same in every repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, free_port, loadgen, rss_mb, wait_http

from pipeline.embedded import EmbeddedNatsServer
from pipeline.streams import PAYLOAD_OBJECT_HEADER
from stream_gateway.models import resolve_model

MODEL = "tiny-moe"
EVENTS_STREAM = "SG_EVENTS"
CATEGORIES = ("events", "objects", "kv", "other")  # where bytes on NATS landed, by stream


@dataclass(slots=True)
class Gateway:
    """One gateway under test: a name, its URL and process, and its runs by concurrency."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    runs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    sample: dict[str, Any] | None = None  # the last turn.completed it published, summarised


def start_gateway(name: str, nats_url: str, outbox: Path, extra: list[str]) -> Gateway:
    """A transformers-engine gateway serving tiny-moe, capturing to ``nats_url``."""
    port = free_port()
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "transformers",
               "--model", resolve_model(MODEL), "--served-model-name", MODEL, "--port", str(port),
               "--log-level", "warning", "--default-max-tokens", "4096",
               "--nats-url", nats_url, "--outbox-dir", str(outbox), *extra]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", process, timeout=300)
    return Gateway(name, url, process)


def category(stream: str) -> str:
    if stream == EVENTS_STREAM:
        return "events"
    if stream.startswith("OBJ_"):
        return "objects"
    if stream.startswith("KV_"):
        return "kv"
    return "other"


class Nats:
    """One nats-py connection on a loop of its own, for stream sizes and reading events back."""

    def __init__(self, url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._nc = self._loop.run_until_complete(nats.connect(url, max_reconnect_attempts=2, connect_timeout=5))
        self._js = self._nc.jetstream()

    def close(self) -> None:
        self._loop.run_until_complete(self._nc.close())
        self._loop.close()

    def sizes(self) -> dict[str, dict[str, int]]:
        """Every stream's stored bytes, messages and last sequence, by name."""
        infos = self._loop.run_until_complete(self._js.streams_info())
        return {
            str(i.config.name): {"bytes": i.state.bytes, "messages": i.state.messages, "last_seq": i.state.last_seq}
            for i in infos
        }

    def last_turn(self, scan: int = 64) -> dict[str, Any] | None:
        """The newest ``turn.completed`` on the events stream, summarised (its size, its routes)."""

        async def find() -> dict[str, Any] | None:
            info = await self._js.stream_info(EVENTS_STREAM)
            for seq in range(info.state.last_seq, max(info.state.first_seq, info.state.last_seq - scan) - 1, -1):
                msg = await self._js.get_msg(EVENTS_STREAM, seq)
                if not (msg.subject or "").endswith(".turn.completed"):
                    continue
                if msg.headers and PAYLOAD_OBJECT_HEADER in msg.headers:
                    return {"in_object_store": True, "message_bytes": len(msg.data or b"")}
                event = orjson.loads(msg.data or b"{}")
                routes = event.get("routed_experts")
                return {
                    "in_object_store": False,
                    "message_bytes": len(msg.data or b""),
                    "prompt_tokens": event["usage"]["prompt_tokens"],
                    "completion_tokens": event["usage"]["completion_tokens"],
                    "routes_shape": routes["shape"] if routes else None,
                    "routes_dtype": routes["dtype"] if routes else None,
                    "routes_base64_bytes": len(routes["data"]) if routes else 0,
                    "routes_json_bytes": len(orjson.dumps(routes)) if routes else 0,
                }
            return None

        return self._loop.run_until_complete(find())


def pending(gateway: Gateway) -> float:
    """The gateway's events not yet acknowledged by NATS (``gateway_events_pending``)."""
    for line in httpx.get(gateway.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway_events_pending "):
            return float(line.split()[1])
    return 0.0


def drain(gateway: Gateway, probe: Nats, timeout: float = 30.0) -> dict[str, dict[str, int]]:
    """Stream sizes once the gateway has nothing pending and the events stream stopped growing."""
    deadline = time.monotonic() + timeout
    last = probe.sizes()
    while True:
        time.sleep(0.1)
        now = probe.sizes()
        settled = now.get(EVENTS_STREAM, {}).get("last_seq") == last.get(EVENTS_STREAM, {}).get("last_seq")
        if (settled and pending(gateway) == 0) or time.monotonic() > deadline:
            return now
        last = now


def one_run(gateway: Gateway, probe: Nats, nats_pid: int, streams: int, tokens: int, requests: int) -> dict[str, Any]:
    sizes = probe.sizes()
    server, nats_cpu = cpu_s(gateway.process.pid), cpu_s(nats_pid)
    result = loadgen(gateway.url, MODEL, streams, tokens, requests=requests)
    after = drain(gateway, probe)
    result["server_cpu_s"] = cpu_s(gateway.process.pid) - server
    result["nats_cpu_s"] = cpu_s(nats_pid) - nats_cpu
    result["server_rss_mb"] = rss_mb(gateway.process.pid)
    grown = {c: 0 for c in CATEGORIES}
    for name, now in after.items():
        grown[category(name)] += now["bytes"] - sizes.get(name, {}).get("bytes", 0)
    for c in CATEGORIES:
        result[f"{c}_bytes"] = grown[c]
    result["events"] = after[EVENTS_STREAM]["messages"] - sizes.get(EVENTS_STREAM, {}).get("messages", 0)
    return result


def per_1k(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key] / r["tokens"] * 1000) for r in runs if r["tokens"])


def per_token(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key] / r["tokens"]) for r in runs if r["tokens"])


def summary(gateway: Gateway, streams: int) -> dict[str, Any]:
    runs = gateway.runs[streams]
    row: dict[str, Any] = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "server_cpu_per_1k": per_1k(runs, "server_cpu_s"),
        "nats_cpu_per_1k": per_1k(runs, "nats_cpu_s"),
        "client_cpu_per_1k": per_1k(runs, "client_cpu_s"),
        "events_per_1k": per_1k(runs, "events"),
        "errors": sum(r["errors"] for r in runs),
        "rss_mb": max(r["server_rss_mb"] for r in runs),
    }
    for c in CATEGORIES:
        row[f"{c}_bytes_per_token"] = per_token(runs, f"{c}_bytes")
    row["nats_bytes_per_token"] = statistics.median(
        sum(r[f"{c}_bytes"] for c in CATEGORIES) / r["tokens"] for r in runs if r["tokens"]
    )
    return row


def paired(on: Gateway, off: Gateway, streams: int, key: str) -> float | None:
    """Median over repeats of (routes on / routes off) of ``key`` per token, each repeat's pair apart."""
    ratios = []
    for a, b in zip(on.runs[streams], off.runs[streams], strict=True):
        x, y = a[key] / a["tokens"], b[key] / b["tokens"]
        if y > 0:
            ratios.append(x / y)
    return statistics.median(ratios) if ratios else None


def expected_routes(tokens: int) -> dict[str, Any]:
    """The routes' size as the model's config says: ids per position, raw and in base64."""
    config = json.loads((Path(resolve_model(MODEL)) / "config.json").read_text())
    experts = int(config.get("num_experts") or config.get("num_local_experts"))
    top_k = int(config["num_experts_per_tok"])
    step, dense = int(config.get("decoder_sparse_step", 1)), set(config.get("mlp_only_layers", []))
    layers = sum(1 for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    per_id = 1 if experts <= 256 else 2
    raw = layers * top_k * per_id
    return {
        "layers": layers, "experts": experts, "top_k": top_k, "id_bytes": per_id,
        "raw_bytes_per_position": raw, "base64_bytes_per_position": raw * 4 / 3, "tokens": tokens,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--tokens-per-run", type=int, default=8192, help="tokens per measured run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    resolve_model(MODEL)  # build tiny-moe once, before two gateways race to
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as nats_server:
        assert nats_server.pid is not None
        gateways: list[Gateway] = []
        probe: Nats | None = None
        try:
            gateways.append(start_gateway("routes on", nats_server.url, Path(tmp) / "outbox-on", []))
            gateways.append(
                start_gateway("routes off", nats_server.url, Path(tmp) / "outbox-off", ["--no-routed-experts"])
            )
            probe = Nats(nats_server.url)
            for gateway in gateways:  # warm-up: torch, the tokenizer, the stream and buckets
                loadgen(gateway.url, MODEL, 4, 64, requests=2)
                drain(gateway, probe)
            for repeat in range(args.repeats):
                for streams in args.streams:
                    order = gateways[repeat % len(gateways) :] + gateways[: repeat % len(gateways)]
                    for gateway in order:
                        requests = max(1, args.tokens_per_run // (streams * args.tokens))
                        run = one_run(gateway, probe, nats_server.pid, streams, args.tokens, requests)
                        gateway.runs.setdefault(streams, []).append(run)
                        gateway.sample = probe.last_turn()
                        nats_bytes = sum(run[f"{c}_bytes"] for c in CATEGORIES)
                        print(
                            f"[{repeat + 1}/{args.repeats}] {gateway.name:10} {streams:3} streams: "
                            f"{run['tokens_per_s']:7.0f} tok/s, "
                            f"{run['server_cpu_s'] / max(run['tokens'], 1) * 1000:.3f} CPU-s/1k, "
                            f"{nats_bytes / max(run['tokens'], 1):.1f} B/token on NATS, {run['errors']} errors",
                            file=sys.stderr,
                            flush=True,
                        )
            on, off = gateways
            result = {
                "model": MODEL,
                "tokens": args.tokens,
                "tokens_per_run": args.tokens_per_run,
                "repeats": args.repeats,
                "health": httpx.get(on.url + "/health").json(),
                "expected_routes": expected_routes(args.tokens),
                "sample_turn": {g.name: g.sample for g in gateways},
                "servers": {g.name: {str(n): summary(g, n) for n in args.streams} for g in gateways},
                "paired_ratios": {
                    str(n): {
                        "server_cpu": paired(on, off, n, "server_cpu_s"),
                        "nats_cpu": paired(on, off, n, "nats_cpu_s"),
                        "events_bytes": paired(on, off, n, "events_bytes"),
                    }
                    for n in args.streams
                },
            }
        finally:
            if probe is not None:
                probe.close()
            for gateway in gateways:
                gateway.process.terminate()
                gateway.process.wait(30)
    report(result)
    if args.json:
        args.json.write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


def _fmt(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "n/a"


def _ratio(on: dict[str, Any], off: dict[str, Any], key: str) -> str:
    return _fmt(on[key] / off[key] if off[key] else None)


def report(result: dict[str, Any]) -> None:
    servers = result["servers"]
    health = result["health"]
    print(f"\n{result['model']} on the {health.get('engine')} engine; {result['tokens']}-token streams, "
          f"{result['tokens_per_run']} tokens per run, medians of {result['repeats']}; "
          "bytes: stored on NATS per streamed token")  # fmt: skip
    print(f"{'server':10} {'streams':>7} {'tok/s':>7} {'CPU-s/1k':>9} {'nats/1k':>8} {'client/1k':>9} "
          f"{'events B/tok':>12} {'objects':>7} {'kv':>6} {'all B/tok':>9} {'RSS MB':>7} {'errors':>6}")  # fmt: skip
    for name, rows in servers.items():
        for streams, row in rows.items():
            print(
                f"{name:10} {streams:>7} {row['tokens_per_s']:7.0f} {row['server_cpu_per_1k']:9.3f} "
                f"{row['nats_cpu_per_1k']:8.4f} {row['client_cpu_per_1k']:9.4f} "
                f"{row['events_bytes_per_token']:12.1f} {row['objects_bytes_per_token']:7.1f} "
                f"{row['kv_bytes_per_token']:6.1f} {row['nats_bytes_per_token']:9.1f} {row['rss_mb']:7.0f} "
                f"{row['errors']:6}"
            )
    on, off = servers.get("routes on"), servers.get("routes off")
    if on and off:
        print("\nroutes on / off (ratio of the medians; median of each repeat's pair in brackets):")
        for streams in on:
            pair = result["paired_ratios"][streams]
            a, b = on[streams], off[streams]
            print(
                f"  {streams:>3} streams: gateway CPU per token {_ratio(a, b, 'server_cpu_per_1k')} "
                f"({_fmt(pair['server_cpu'])}), nats-server CPU per token {_ratio(a, b, 'nats_cpu_per_1k')} "
                f"({_fmt(pair['nats_cpu'])}), events bytes per token {_ratio(a, b, 'events_bytes_per_token')} "
                f"({_fmt(pair['events_bytes'])}), all bytes per token {_ratio(a, b, 'nats_bytes_per_token')}, "
                f"tokens/s {_ratio(a, b, 'tokens_per_s')}"
            )
            added = on[streams]["events_bytes_per_token"] - off[streams]["events_bytes_per_token"]
            print(f"             events bytes added by routes: {added:.1f} B per streamed token")
    exp = result["expected_routes"]
    print(
        f"\nexpected routes payload: {exp['layers']} MoE layers x top-{exp['top_k']} of {exp['experts']} experts, "
        f"{exp['id_bytes']} B per id = {exp['raw_bytes_per_position']} B per position raw, "
        f"{exp['base64_bytes_per_position']:.1f} B in base64"
    )
    sample = (result["sample_turn"] or {}).get("routes on")
    if sample and sample.get("routes_shape"):
        rows, tokens = sample["routes_shape"][0], sample["completion_tokens"]
        print(
            f"  one recorded turn.completed (routes on): prompt {sample['prompt_tokens']} + output {tokens} tokens, "
            f"routes shape {sample['routes_shape']} {sample['routes_dtype']} (prompt + output - 1 positions), "
            f"{sample['routes_base64_bytes']} B base64 ({sample['routes_json_bytes']} B as JSON) in a "
            f"{sample['message_bytes']} B message: {sample['routes_json_bytes'] / tokens:.1f} B per streamed "
            f"token, {exp['base64_bytes_per_position'] * rows / tokens:.1f} B expected"
        )
    off_sample = (result["sample_turn"] or {}).get("routes off")
    if off_sample:
        print(
            f"  routes off: routed_experts {off_sample.get('routes_shape') or 'absent'}, "
            f"a {off_sample['message_bytes']} B turn.completed message"
        )


if __name__ == "__main__":
    main()
