"""Where a relayed request's time goes before its first token: timestamps at each step, inside the front.

Run (from the repository root, after ``bash scripts/install.sh``)::

    .venv/bin/python benchmarks/request_steps.py                       # 1,000 sequential 2-token streams
    .venv/bin/python benchmarks/request_steps.py --requests 300 --capture --first-token-ms 20
    .venv/bin/python benchmarks/request_steps.py --capture --tree /tmp/base     # another checkout's front

Set-up: ``benchmarks/paced_upstream.py`` answering at once (``--first-token-ms 0`` by default), and a
``vllm-http`` front (``stream-gateway serve``, capture off unless ``--capture``: then an embedded
nats-server) started by this script with ``--front``: the same front, with a clock read at the steps
below by wrappers around the functions named (nothing else changes). One connection sends
``--requests`` streamed chat requests of ``--tokens`` tokens one after the other (``loadgen.py``), so
the front has nothing else to do; the first ``--warmup`` are not counted. Printed: the median time of
each step after uvicorn parsed the request's headers, the median time the front took per request, and
the first token's p50 at the client.

Steps (each the first time it happens in a request):

* ``handler``: the generation handler entered (``http/generation.py``'s ``_limited``)
* ``body read`` / ``body parsed``: the body received, then parsed and validated
* ``prompt built``: the chat template rendered and tokenized (``Preparer._build_context``)
* ``opened``: the edge's ``open`` returned (session, prompt, admission)
* ``response``: the streamed response starts (``TokenStreamResponse``'s pushed serve)
* ``choice``: the choice's state built (``_Choice.__init__``: the detokenizer, the turn's start)
* ``upstream write``: the request's bytes written to the upstream
* ``upstream bytes``: its first bytes read
* ``first frame``: the first frame written to the client after the upstream's first bytes (the first token's)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent

STEPS = [
    "handler",
    "body read",
    "body parsed",
    "prompt built",
    "opened",
    "response",
    "choice",
    "upstream write",
    "upstream bytes",
    "first frame",
]


def _clock(owner: Any, name: str, tick: Callable[[], None], *, after: bool) -> None:
    """``owner.name`` wrapped to call ``tick`` before it runs or after it returned."""
    function = getattr(owner, name)
    if asyncio.iscoroutinefunction(function):

        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            if not after:
                tick()
            result = await function(*args, **kwargs)
            if after:
                tick()
            return result

        setattr(owner, name, timed_async)
        return

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not after:
            tick()
        result = function(*args, **kwargs)
        if after:
            tick()
        return result

    setattr(owner, name, timed)


def front(warmup: int, argv: list[str]) -> None:
    """``stream-gateway serve argv`` with a clock read at each step; the medians printed at exit."""
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    from stream_gateway.cli import main
    from stream_gateway.completion import _history, _prepare, _service
    from stream_gateway.engines.remote import _stream_http
    from stream_gateway.http import _sse, generation
    from stream_gateway.protocols import _chat

    now = time.perf_counter
    times: dict[str, float] = {}
    requests: list[dict[str, float]] = []

    def mark(step: str) -> None:
        if step not in times:
            times[step] = now()

    def before(owner: Any, name: str, step: str) -> None:
        _clock(owner, name, lambda: mark(step), after=False)

    def after(owner: Any, name: str, step: str) -> None:
        _clock(owner, name, lambda: mark(step), after=True)

    headers_complete = httptools_impl.HttpToolsProtocol.on_headers_complete

    def on_headers_complete(self: Any) -> None:
        if "first frame" in times:
            requests.append(dict(times))
        times.clear()
        times["headers"] = now()
        headers_complete(self)

    httptools_impl.HttpToolsProtocol.on_headers_complete = on_headers_complete  # type: ignore[method-assign]
    before(generation, "_limited", "handler")
    after(generation, "read_body", "body read")
    after(_history.Histories, "parse", "body parsed")
    after(_prepare.Preparer, "_build_context", "prompt built")
    after(_chat.ChatEdge, "open", "opened")
    before(_sse.TokenStreamResponse, "_serve_pushed", "response")
    after(_service._Choice, "__init__", "choice")
    before(_stream_http._Connection, "send", "upstream write")
    before(_stream_http._Connection, "data_received", "upstream bytes")
    write = _sse._Writer.write

    def first_frame(self: Any, frame: bytes) -> None:
        write(self, frame)
        if "upstream bytes" in times:
            mark("first frame")

    _sse._Writer.write = first_frame  # type: ignore[method-assign]

    def report() -> None:
        counted = requests[warmup:]
        if not counted:
            return
        lines = [f"{len(counted)} requests; median ms after uvicorn parsed the request's headers:"]
        for step in STEPS:
            values = [(r[step] - r["headers"]) * 1000 for r in counted if step in r]
            if values:
                lines.append(f"  {step:16} {statistics.median(values):6.3f}")
        print("\n".join(lines), file=sys.stderr, flush=True)

    import atexit

    atexit.register(report)
    sys.argv = ["stream-gateway", *argv]
    main()


def run(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    import subprocess
    from contextlib import ExitStack

    import loadgen
    from _procs import cpu_s, free_port, wait_http
    from relay import MODEL, start_upstream

    from pipeline.embedded import EmbeddedNatsServer
    from stream_gateway.models import resolve_model

    model_dir = resolve_model(args.model)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        upstream, upstream_url = start_upstream(model_dir, args.rate, args.first_token_ms)
        stack.callback(upstream.terminate)
        capture: list[str] = []
        if args.capture:
            nats = stack.enter_context(EmbeddedNatsServer())
            capture = ["--nats-url", nats.url, "--outbox-dir", str(Path(tmp) / "outbox")]
        port = free_port()
        command = [sys.executable, __file__, "--front", str(args.warmup), "serve", "--engine", "vllm-http",
                   "--upstream", upstream_url,
                   "--model", model_dir, "--served-model-name", MODEL, "--port", str(port), "--log-level", "warning",
                   *capture]  # fmt: skip
        environment = dict(os.environ)
        if args.tree is not None:  # that checkout's package first (the steps' functions must exist there)
            environment["PYTHONPATH"] = str(args.tree.resolve())
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=environment)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", process)

        def streams(requests: int) -> dict[str, Any]:
            return asyncio.run(loadgen.run(url, model=MODEL, streams=1, tokens=args.tokens, requests=requests))

        streams(args.warmup)
        before = cpu_s(process.pid)
        result = streams(args.requests)
        spent = cpu_s(process.pid) - before
        process.send_signal(2)  # SIGINT: uvicorn shuts down, the front prints its medians
        process.wait(30)
        print(f"  front CPU per request {spent / args.requests * 1000:.2f} ms; first token p50 at the client "
              f"{result['first_token']['p50_ms']:.3f} ms ({args.tokens}-token streams, upstream's first token "
              f"after {args.first_token_ms:g} ms)", file=sys.stderr)  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--front"]:  # the front this script starts: --front WARMUP serve ...
        front(int(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=2, help="max_tokens of each stream (2: a first token that "
                        "is not the last, which vLLM's reader would hold for the usage frame)")  # fmt: skip
    parser.add_argument("--rate", type=float, default=5000.0,
                        help="the upstream's tokens/s per stream (fast: a front left idle between requests runs the "
                             "next on a cold CPU, about twice as slow)")  # fmt: skip
    parser.add_argument("--first-token-ms", type=float, default=0.0, help="the upstream's prefill time")
    parser.add_argument("--capture", action="store_true", help="capture on: an embedded nats-server")
    parser.add_argument("--model", default="tiny-agent")
    parser.add_argument("--tree", type=Path, help="run the front of another checkout (before/after a change)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
