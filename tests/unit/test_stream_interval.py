"""How many tokens a frame the front asks of a vLLM server (``engines/remote/_interval.py``).

One while the loop keeps up; as many as a stream samples during the loop's lateness when it does
not, within the configured bounds. The lateness is a real event loop's, blocked on purpose."""

from __future__ import annotations

import time

import anyio
import pytest

from stream_gateway.engines.remote._interval import LoopLag, StreamIntervals


def test_one_token_a_frame_until_the_loop_runs_late() -> None:
    intervals = StreamIntervals(1, 8)
    assert intervals.next() == 1  # no finished turn yet: no pace to scale by
    intervals.finished(tokens=101, seconds=2.0)  # 20 ms a token
    assert intervals.next() == 1  # on time
    intervals.lag.seconds = 0.065  # three tokens sampled while the loop was late
    assert intervals.next() == 3
    intervals.lag.seconds = 5.0
    assert intervals.next() == 8  # never above the most


def test_the_pace_is_a_moving_average_of_finished_turns() -> None:
    intervals = StreamIntervals(1, 16)
    intervals.finished(tokens=1, seconds=0.0)  # a one-token turn says nothing of a pace
    intervals.finished(tokens=11, seconds=0.0)
    assert intervals.per_token is None
    intervals.finished(tokens=11, seconds=1.0)
    assert intervals.per_token == pytest.approx(0.1)
    intervals.finished(tokens=11, seconds=0.1)  # a faster server: the average moves a fifth of the way
    assert intervals.per_token == pytest.approx(0.1 + (0.01 - 0.1) * 0.2)


def test_fixed_bounds() -> None:
    fixed = StreamIntervals(4, 4)
    fixed.finished(tokens=11, seconds=0.1)
    fixed.lag.seconds = 1.0
    assert not fixed.adaptive and fixed.next() == 4
    floor = StreamIntervals(2, 6)
    floor.finished(tokens=11, seconds=1.0)
    assert floor.next() == 2  # the least even on time
    with pytest.raises(ValueError, match="least <= most"):
        StreamIntervals(3, 2)
    with pytest.raises(ValueError, match="least <= most"):
        StreamIntervals(0, 2)


def test_the_lag_of_a_blocked_loop() -> None:
    """A loop blocked for 200 ms runs the timer at least 100 ms late: the average rises to a quarter
    of that at once; an idle loop's falls back."""

    async def run() -> tuple[float, float]:
        lag = LoopLag()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lag.run)
            await anyio.sleep(0.01)  # the timer is set
            time.sleep(0.2)  # blocks the loop
            await anyio.sleep(LoopLag.PERIOD_S * 1.5)
            blocked = lag.seconds
            await anyio.sleep(LoopLag.PERIOD_S * 12)
            tg.cancel_scope.cancel()
        return blocked, lag.seconds

    blocked, later = anyio.run(run)
    assert blocked >= 0.1 * LoopLag.WEIGHT
    assert later < blocked / 2
