"""A load generator for streamed chat completions that costs far less CPU than what it measures.

Run it in a process of its own (the benchmarks do), so its CPU is counted apart from the server's::

    .venv/bin/python benchmarks/loadgen.py --url http://127.0.0.1:8000 --model tiny --streams 64 --tokens 256

Each stream is one keep-alive HTTP/1.1 connection (a raw ``asyncio.Protocol``, on uvloop when it
is installed) that sends ``--requests`` streamed requests one after the other. Nothing is parsed
per token: a received packet is scanned once for SSE frame starts (``data: ``) and the chunked
transfer encoding's end; only the usage frame at the end of each response is decoded (the server
is asked for it with ``stream_options.include_usage``), which gives the exact number of tokens. Per
response it keeps: time to the first content frame (the second frame: the first carries the
role), the times between frames after that, frames and tokens (tokens per frame, not counting the
role, usage and ``[DONE]`` frames: 1.0 means every token was its own chunk, more shows a server
coalescing tokens into chunks), and errors (a status other than 200, a connection lost early, an
error frame, a usage count that differs from ``max_tokens`` with ``ignore_eos``).

The result is one JSON object on stdout: totals, percentiles and the generator's own CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

_DONE = b"data: [DONE]"
_END = b"0\r\n\r\n"  # the last chunk of a chunked response


@dataclass(slots=True)
class Totals:
    """What all streams saw."""

    responses: int = 0
    errors: int = 0
    frames: int = 0
    tokens: int = 0
    first_token_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    durations_s: list[float] = field(default_factory=list)  # request sent to response ended
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what)


class _Response(asyncio.Protocol):
    """One connection; each ``request()`` sends a request and resolves when its response ended."""

    def __init__(self, totals: Totals, keep_gaps: bool) -> None:
        self._totals = totals
        self._keep_gaps = keep_gaps
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[None] | None = None
        self._buffer = b""  # the response head until it is complete
        self._recent: list[bytes] = []
        self._frames = 0
        self._sent = 0.0
        self._last = 0.0
        self._status_checked = False
        self._usage: bytes | None = None
        self.lost: BaseException | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("connection closed")
        if self._done is not None and not self._done.done():
            self._done.set_exception(self.lost)

    def request(self, payload: bytes) -> asyncio.Future[None]:
        assert self._transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self._buffer = b""
        self._recent = []
        self._frames = 0
        self._status_checked = False
        self._usage = None
        self._sent = self._last = time.perf_counter()
        self._transport.write(payload)
        return self._done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self._status_checked:
            self._buffer += data
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            self._status_checked = True
            status = self._buffer[9:12]
            if status != b"200":
                self._totals.error(f"HTTP {status.decode()}: {self._buffer[head_end + 4 :][:300]!r}")
                self._finish(error=True)
                return
            data = self._buffer[head_end + 4 :]
            self._buffer = b""
        frames = data.count(b"data: ")
        if frames:
            totals = self._totals
            if self._frames < 2 <= self._frames + frames:
                totals.first_token_s.append(now - self._sent)
            elif self._frames >= 2 and self._keep_gaps:
                totals.gaps_s.append(now - self._last)
            self._frames += frames
            self._last = now
        # The usage frame, [DONE] and the last chunk come last, maybe in packets of their own:
        # keep references to the last few packets to look for them once the last chunk is seen.
        recent = self._recent
        recent.append(data)
        if len(recent) > 4:
            del recent[0]
        if data.endswith(_END) or (len(data) < len(_END) and b"".join(recent).endswith(_END)):
            window = b"".join(recent)
            if _DONE in window:
                self._usage = window
                self._finish(error=False)

    def _finish(self, *, error: bool) -> None:
        assert self._done is not None
        if not error:
            self._totals.frames += self._frames
            self._totals.durations_s.append(time.perf_counter() - self._sent)
        if not self._done.done():
            self._done.set_result(None)

    def usage_tokens(self) -> int | None:
        """``completion_tokens`` from the usage frame of the response that just ended."""
        window = self._usage
        if window is None:
            return None
        at = window.rfind(b'"usage":')
        if at < 0:
            return None
        start = window.rfind(b"data: ", 0, at) + 6
        frame: dict[str, Any] = orjson.loads(window[start : window.find(b"\n\n", at)])
        tokens: int = frame["usage"]["completion_tokens"]
        return tokens

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def request_bytes(host: str, port: int, path: str, body: dict[str, Any], api_key: str | None) -> bytes:
    """One HTTP/1.1 keep-alive POST with a JSON body."""
    payload = orjson.dumps(body)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\n{auth}Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _stream(
    host: str,
    port: int,
    payloads: list[bytes],
    tokens: int,
    totals: Totals,
    *,
    keep_gaps: bool,
    start_after: float,
    pause_s: float = 0.0,
) -> None:
    await asyncio.sleep(start_after)
    loop = asyncio.get_running_loop()
    try:
        _, protocol = await loop.create_connection(lambda: _Response(totals, keep_gaps), host, port)
    except OSError as exc:
        totals.error(f"connect: {exc}")
        return
    try:
        for number, payload in enumerate(payloads):
            if number and pause_s:
                await asyncio.sleep(pause_s)  # an agent's think time: the server is idle again
            try:
                await protocol.request(payload)
            except (ConnectionError, OSError) as exc:
                totals.error(f"connection lost: {exc!r}")
                return
            totals.responses += 1
            got = protocol.usage_tokens()
            if got is None:
                if totals.errors == 0 or protocol.lost is None:
                    totals.error("response without a usage frame")
                return
            totals.tokens += got
            if tokens and got != tokens:
                totals.error(f"{got} tokens instead of {tokens}")
    finally:
        protocol.close()


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {
        "p50_ms": pick(0.50) * 1000,
        "p90_ms": pick(0.90) * 1000,
        "p99_ms": pick(0.99) * 1000,
        "max_ms": values[-1] * 1000,
        "mean_ms": statistics.fmean(values) * 1000,
    }


async def run(
    url: str,
    *,
    model: str,
    streams: int,
    tokens: int,
    requests: int = 1,
    api_key: str | None = None,
    ramp_s: float = 0.0,
    pause_s: float = 0.0,
    keep_gaps: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Drive ``streams`` connections of ``requests`` streamed requests each; the figures as a dict."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    totals = Totals()
    payloads = []
    for s in range(streams):
        # A different conversation per stream and request: each is a new session, as with real users
        # (and nothing the front keeps by text, such as a render's pieces, sees a message twice).
        payloads.append([
            request_bytes(host, port, "/v1/chat/completions", {
                "model": model,
                "messages": [{"role": "user", "content": f"Tell story {s}.{r} about a lighthouse keeper."}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": tokens,
                "ignore_eos": True,
                **(extra or {}),
            }, api_key)
            for r in range(requests)
        ])  # fmt: skip
    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(
        *(
            _stream(
                host,
                port,
                payloads[s],
                tokens,
                totals,
                keep_gaps=keep_gaps,
                start_after=ramp_s * s / streams,
                pause_s=pause_s,
            )
            for s in range(streams)
        )
    )
    elapsed = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "streams": streams,
        "requests": streams * requests,
        "responses": totals.responses,
        "errors": totals.errors,
        "error_samples": totals.error_samples,
        "tokens": totals.tokens,
        "frames": totals.frames,
        # Frames that carry tokens: all but the role, usage and [DONE] frames of each response.
        "tokens_per_frame": totals.tokens / max(totals.frames - 3 * totals.responses, 1),
        "elapsed_s": elapsed,
        "tokens_per_s": totals.tokens / elapsed if elapsed else 0.0,
        "first_token": _percentiles(totals.first_token_s),
        "gap": _percentiles(totals.gaps_s),
        "response_s": _percentiles(totals.durations_s),
        "stream_seconds": sum(totals.durations_s),
        "client_cpu_s": time.process_time() - cpu,
        "client_max_rss_mb": usage.ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=16, help="concurrent connections")
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each request (with ignore_eos)")
    parser.add_argument("--requests", type=int, default=1, help="requests per connection, one after the other")
    parser.add_argument("--ramp-seconds", type=float, default=0.0, help="spread the connections' starts over this")
    parser.add_argument("--pause-ms", type=float, default=0.0, help="pause between a connection's requests")
    parser.add_argument("--api-key")
    parser.add_argument("--no-gaps", action="store_true", help="do not keep inter-frame gaps")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(
        run(
            args.url,
            model=args.model,
            streams=args.streams,
            tokens=args.tokens,
            requests=args.requests,
            api_key=args.api_key,
            ramp_s=args.ramp_seconds,
            pause_s=args.pause_ms / 1000,
            keep_gaps=not args.no_gaps,
        )
    )
    result["loop"] = type(asyncio.new_event_loop()).__module__.split(".")[0]
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    os._exit(0)  # connections are closed; skip interpreter teardown


if __name__ == "__main__":
    main()
