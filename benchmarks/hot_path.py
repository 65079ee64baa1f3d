"""The per-token hot path: gateway CPU per streamed token, capture on and off, side by side in one run.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/hot_path.py
    .venv/bin/python benchmarks/hot_path.py --streams 1 16 64 --tokens 256 --repeats 5 --json hot.json
    .venv/bin/python benchmarks/hot_path.py --litellm      # adds LiteLLM in front of a fake upstream
    .venv/bin/python benchmarks/hot_path.py --thinking     # adds both gateways on a thinking model's tokenizer
    git worktree add /tmp/before <commit> && .venv/bin/python benchmarks/hot_path.py --baseline-tree /tmp/before
                                                           # adds that commit's gateway (a refactor's before/after)

Set-up, all real processes on this machine: an embedded ``nats-server`` (JetStream, temp store);
two gateways on the synthetic engine (``--model tiny``'s tokenizer, tokens as fast as the loop
allows, so the gateway is all there is to measure): capture off, and capture on (``--nats-url``,
live deltas on, the defaults). With ``--litellm``, also LiteLLM's proxy (its own venv, see
``benchmarks/litellm_env.sh``) relaying ``benchmarks/fake_upstream.py``, which sends pre-encoded
frames and costs next to nothing.

Load: ``benchmarks/loadgen.py`` in a process of its own (raw asyncio sockets, no per-token
parsing: it costs a fraction of the gateway's CPU, and the table shows how much), ``streams``
concurrent keep-alive connections, each sending streamed requests of ``tokens`` tokens
(``ignore_eos``, ``include_usage``) one after the other, ``--tokens-per-run`` tokens in all.
Configurations alternate within every repeat, so drift hits all alike.

Reported per configuration and concurrency (medians over ``repeats``): CPU seconds per 1,000
streamed tokens of the server process (``/proc``), of nats-server and of the load generator;
tokens/s; tokens per frame (1.0 = every token its own chunk); time to first token and the gap
between frames (p50/p99) as the client saw them. Ratios in the summary compare rows of this run.

Time to first token on idle servers is measured apart (``--idle-rounds``), back to back and with
20 ms pauses, beside the fake upstream answering alone ("bare server": the floor this machine,
its loopback and the load generator set). ``--repeats 0`` measures only that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, free_port, loadgen, rss_mb, wait_http

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.models import resolve_model


@dataclass(slots=True)
class Server:
    """One server under test: a name, its URL and model name, and the processes whose CPU counts."""

    name: str
    url: str
    model: str
    process: subprocess.Popen[bytes]
    helpers: dict[str, int] = field(default_factory=dict)  # other processes to account (upstream)
    runs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)  # the server's processes (all of LiteLLM's)

    def cpu_s(self) -> float:
        return sum(cpu_s(pid) for pid in self.pids or [self.process.pid])

    def rss_mb(self) -> float:
        return sum(rss_mb(pid) for pid in self.pids or [self.process.pid])


def start_gateway(name: str, extra: list[str], tree: Path | None = None, model: str = "tiny") -> Server:
    """A synthetic-engine gateway; ``tree``: run another checkout's code (same venv) instead of this one's;
    ``model``: whose tokenizer (``tiny-reasoning``: half of every output is thinking)."""
    port = free_port()
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "synthetic",
               "--model", resolve_model(model), "--served-model-name", "tiny", "--port", str(port),
               "--log-level", "warning", "--default-max-tokens", "4096", *extra]  # fmt: skip
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", process)
    return Server(name, url, "tiny", process)


def start_upstream() -> tuple[Server, subprocess.Popen[bytes]]:
    """``fake_upstream.py``: LiteLLM's upstream, and the do-nothing server whose time to first token is the floor."""
    port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("fake_upstream.py")), "--port", str(port)],
        stdout=subprocess.PIPE,
    )
    assert upstream.stdout is not None
    upstream.stdout.readline()  # "ready"
    return Server("bare server", f"http://127.0.0.1:{port}", "tiny", upstream), upstream


def start_litellm(workdir: Path, upstream_url: str, upstream_pid: int) -> Server:
    from litellm_proxy import session_pids, write_config
    from litellm_proxy import start_litellm as start_proxy

    config = workdir / "litellm.yaml"
    write_config(config, upstream_url, "tiny")
    port = free_port()
    proxy = start_proxy(config, port)
    server = Server("litellm", f"http://127.0.0.1:{port}", "tiny", proxy, {"upstream": upstream_pid})
    server.pids = session_pids(proxy)
    return server


def one_run(server: Server, nats_pid: int | None, streams: int, tokens: int, requests: int) -> dict[str, Any]:
    before = server.cpu_s()
    helpers = {name: cpu_s(pid) for name, pid in server.helpers.items()}
    nats_before = cpu_s(nats_pid) if nats_pid else 0.0
    result = loadgen(server.url, server.model, streams, tokens, requests=requests)
    result["server_cpu_s"] = server.cpu_s() - before
    result["nats_cpu_s"] = (cpu_s(nats_pid) - nats_before) if nats_pid else 0.0
    for name, pid in server.helpers.items():
        result[f"{name}_cpu_s"] = cpu_s(pid) - helpers[name]
    result["server_rss_mb"] = server.rss_mb()
    return result


def per_1k(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] / r["tokens"] * 1000 for r in runs if r["tokens"])


def summary(server: Server, streams: int) -> dict[str, Any]:
    runs = server.runs[streams]
    med: Callable[[Callable[[dict[str, Any]], float]], float] = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    row = {
        "server_cpu_per_1k": per_1k(runs, "server_cpu_s"),
        "nats_cpu_per_1k": per_1k(runs, "nats_cpu_s"),
        "client_cpu_per_1k": per_1k(runs, "client_cpu_s"),
        "tokens_per_s": med(lambda r: r["tokens_per_s"]),
        "tokens_per_frame": med(lambda r: r["tokens_per_frame"]),
        "first_token_p50_ms": med(lambda r: r["first_token"].get("p50_ms", 0.0)),
        "gap_p50_ms": med(lambda r: r["gap"].get("p50_ms", 0.0)),
        "gap_p99_ms": med(lambda r: r["gap"].get("p99_ms", 0.0)),
        "errors": sum(r["errors"] for r in runs),
        "rss_mb": max(r["server_rss_mb"] for r in runs),
    }
    for name in server.helpers:
        row[f"{name}_cpu_per_1k"] = per_1k(runs, f"{name}_cpu_s")
    return row


def idle_first_token(servers: list[Server], rounds: int, samples: int = 20) -> dict[str, dict[str, float]]:
    """Time to first token of sequential 2-token streams on otherwise idle servers, in ms.

    Two ways: ``back_to_back`` (each request sent when the last one ended) and ``paused`` (20 ms
    apart, as an agent's think time: nothing of the last request is still running, but the
    machine has gone idle, and on this VM everything then runs slower). Per round and server, the
    p50 of ``samples`` streams; servers alternate within each round; the median over rounds.
    """
    modes = {"back_to_back": [], "paused": ["--pause-ms", "20"]}
    seen: dict[str, dict[str, list[float]]] = {s.name: {mode: [] for mode in modes} for s in servers}
    for _ in range(rounds):
        for mode, extra in modes.items():
            for server in servers:
                result = loadgen(server.url, server.model, 1, 2, requests=samples, extra=extra)
                seen[server.name][mode].append(float(result["first_token"]["p50_ms"]))
    return {name: {mode: statistics.median(v) for mode, v in by_mode.items()} for name, by_mode in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--tokens-per-run", type=int, default=65536, help="tokens per measured run")
    parser.add_argument("--repeats", type=int, default=3, help="0: only the idle time to first token")
    parser.add_argument("--idle-rounds", type=int, default=5, help="rounds of the idle time-to-first-token probe")
    parser.add_argument("--litellm", action="store_true", help="also measure LiteLLM's proxy (needs its venv)")
    parser.add_argument(
        "--litellm-tokens-per-run", type=int, default=16384, help="LiteLLM costs ~10x more per token: fewer tokens"
    )
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="also run both gateways with tiny-reasoning's tokenizer: half of every output is a thinking block",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--baseline-tree", type=Path, help="also run the gateway of this checkout (e.g. the commit before a change)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as nats:
        nats_pid = nats.pid
        servers = [
            start_gateway("capture off", []),
            start_gateway("capture on", ["--nats-url", nats.url, "--outbox-dir", str(Path(tmp) / "outbox")]),
        ]
        if args.thinking:
            servers.append(start_gateway("thinking off", [], model="tiny-reasoning"))
            outbox = str(Path(tmp) / "outbox-thinking")
            capture = ["--nats-url", nats.url, "--outbox-dir", outbox]
            servers.append(start_gateway("thinking on", capture, model="tiny-reasoning"))
        if args.baseline_tree is not None:
            tree = args.baseline_tree.resolve()
            servers.append(start_gateway("before off", [], tree))
            outbox = str(Path(tmp) / "outbox-before")
            servers.append(start_gateway("before on", ["--nats-url", nats.url, "--outbox-dir", outbox], tree))
        bare, upstream = start_upstream()
        if args.litellm:
            servers.append(start_litellm(Path(tmp), bare.url, upstream.pid))
        try:
            for server in servers:  # warm-up
                loadgen(server.url, server.model, 4, 64, requests=2)
            for repeat in range(args.repeats):
                for streams in args.streams:
                    order = servers[repeat % len(servers) :] + servers[: repeat % len(servers)]
                    for server in order:
                        budget = args.litellm_tokens_per_run if server.name == "litellm" else args.tokens_per_run
                        requests = max(1, budget // (streams * args.tokens))
                        uses_nats = server.name in ("capture on", "before on", "thinking on")
                        run = one_run(server, nats_pid if uses_nats else None, streams, args.tokens, requests)
                        server.runs.setdefault(streams, []).append(run)
                        print(
                            f"[{repeat + 1}/{args.repeats}] {server.name:12} {streams:3} streams: "
                            f"{run['tokens_per_s']:8.0f} tok/s, "
                            f"{run['server_cpu_s'] / max(run['tokens'], 1) * 1000:.3f} CPU-s/1k, "
                            f"{run['tokens_per_frame']:.2f} tok/frame, {run['errors']} errors",
                            file=sys.stderr,
                            flush=True,
                        )
            idle = idle_first_token([bare, *servers], args.idle_rounds) if args.idle_rounds > 0 else {}
            result = {
                "tokens": args.tokens,
                "repeats": args.repeats,
                "health": httpx.get(servers[0].url + "/health").json(),
                "servers": {s.name: {str(n): summary(s, n) for n in args.streams} for s in servers if s.runs},
                "idle_first_token_ms": idle,
                "idle_rounds": args.idle_rounds,
            }
        finally:
            for server in servers:
                if server.name == "litellm":
                    from litellm_proxy import stop_litellm

                    stop_litellm(server.process)
                    continue
                server.process.terminate()
                server.process.wait(30)
            upstream.terminate()
            upstream.wait(10)
    report(result)
    if args.json:
        args.json.write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


def report(result: dict[str, Any]) -> None:
    servers = result["servers"]
    health = result["health"]
    print(f"\nserver loop/parser: {health.get('server', 'unknown')}; {result['tokens']}-token streams, "
          f"medians of {result['repeats']}")  # fmt: skip
    print(f"{'server':12} {'streams':>7} {'CPU-s/1k':>9} {'nats':>6} {'client':>7} {'tok/s':>8} "
          f"{'tok/frame':>9} {'TTFT p50':>9} {'gap p50':>8} {'gap p99':>8} {'RSS MB':>7} {'errors':>6}")  # fmt: skip
    for name, rows in servers.items():
        for streams, row in rows.items():
            print(
                f"{name:12} {streams:>7} {row['server_cpu_per_1k']:9.3f} {row['nats_cpu_per_1k']:6.3f} "
                f"{row['client_cpu_per_1k']:7.3f} {row['tokens_per_s']:8.0f} {row['tokens_per_frame']:9.2f} "
                f"{row['first_token_p50_ms']:8.1f}ms {row['gap_p50_ms']:6.2f}ms {row['gap_p99_ms']:6.2f}ms "
                f"{row['rss_mb']:7.0f} {row['errors']:6}"
            )
    idle = result["idle_first_token_ms"]
    floor = idle.get("bare server", {})
    if idle:
        print(f"\nidle time to first token, p50 of 20 sequential 2-token streams, median of {result['idle_rounds']} "
              "rounds (added: over the bare server, which does nothing but answer):")  # fmt: skip
    for name, by_mode in idle.items():
        parts = []
        for mode, ms in by_mode.items():
            added = f" (added {ms - floor[mode]:.2f})" if name != "bare server" else ""
            parts.append(f"{mode.replace('_', '-')} {ms:.2f} ms{added}")
        print(f"  {name:12} " + "; ".join(parts))
    on, off = servers.get("capture on"), servers.get("capture off")
    if on and off:
        for streams in on:
            ratio = on[streams]["server_cpu_per_1k"] / off[streams]["server_cpu_per_1k"]
            print(f"capture on / off, CPU per token at {streams} streams: {ratio:.3f}")
    for mode in ("off", "on"):
        now, before = servers.get(f"capture {mode}"), servers.get(f"before {mode}")
        if now and before:
            for streams in now:
                ratio = now[streams]["server_cpu_per_1k"] / before[streams]["server_cpu_per_1k"]
                print(f"this tree / baseline tree, capture {mode}, CPU per token at {streams} streams: {ratio:.3f}")
    for mode in ("off", "on"):
        thinking, plain = servers.get(f"thinking {mode}"), servers.get(f"capture {mode}")
        if thinking and plain:
            for streams in thinking:
                ratio = thinking[streams]["server_cpu_per_1k"] / plain[streams]["server_cpu_per_1k"]
                print(f"thinking / plain model, capture {mode}, CPU per token at {streams} streams: {ratio:.3f}")
    lite = servers.get("litellm")
    if lite and on:
        for streams in on:
            ratio = lite[streams]["server_cpu_per_1k"] / on[streams]["server_cpu_per_1k"]
            print(f"LiteLLM / gateway (capture on), CPU per token at {streams} streams: {ratio:.1f}x")


if __name__ == "__main__":
    main()
