"""The remote engines' server pick: a session's home is the same in every process (``--workers N``)."""

from __future__ import annotations

import pytest

from stream_gateway._errors import EngineUnavailable
from stream_gateway.engines._pool import HOME_SLACK, UpstreamPool

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def pool(urls: list[str] = URLS) -> UpstreamPool:
    made = UpstreamPool(urls)
    for upstream in made:
        upstream.healthy = True
    return made


def test_two_processes_send_every_session_to_the_same_server_and_spread_them() -> None:
    one, two = pool(), pool()
    keys = [f"sess_{i:05d}" for i in range(2000)]
    picked = [one.pick(key).url for key in keys]
    assert picked == [two.pick(key).url for key in reversed(keys)][::-1]  # another order, the same homes
    counts = {url: picked.count(url) for url in URLS}
    assert all(400 <= n <= 600 for n in counts.values()), counts  # 500 each, give or take
    assert sum(u.picks["home"] for u in one) == 2000
    assert [one.pick(key).url for key in keys[:100]] == picked[:100]
    assert sum(u.picks["sticky"] for u in one) == 100


def test_a_busy_home_sends_a_new_session_to_the_least_busy_server() -> None:
    p = pool()
    home = p.pick("sess_a")
    fresh = pool()
    for upstream in fresh:
        if upstream.url == home.url:
            upstream.outstanding = HOME_SLACK - 1
    assert fresh.pick("sess_a").url == home.url  # within the slack: still home
    fresh = pool()
    for upstream in fresh:
        upstream.outstanding = HOME_SLACK if upstream.url == home.url else 0
    moved = fresh.pick("sess_a")
    assert moved.url != home.url and moved.picks["moved"] == 1
    assert fresh.pick("sess_a") is moved  # and it sticks there


def test_a_server_leaving_moves_only_the_sessions_it_was_home_to() -> None:
    keys = [f"sess_{i:05d}" for i in range(1000)]
    before = {key: pool().pick(key).url for key in keys}
    fewer = pool(URLS[:-1])
    after = {key: fewer.pick(key).url for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == URLS[-1] for key in moved)
    unhealthy = pool()
    for upstream in unhealthy:
        upstream.healthy = upstream.url != URLS[-1]
    assert {key: unhealthy.pick(key).url for key in keys} == after  # the next in rank, as without it


def test_no_healthy_server_is_refused() -> None:
    p = UpstreamPool(URLS)
    with pytest.raises(EngineUnavailable):
        p.pick("sess_a")


def test_a_check_missed_while_streaming_or_reloading_is_forgiven_and_one_missed_idle_is_not() -> None:
    """``_forgive_slow_check``: a real vLLM answered its ``/health`` late while this gateway loaded
    weights into it, and the pool took its only server out (the next request found none)."""
    import time

    from stream_gateway.engines._pool import Upstream
    from stream_gateway.engines.remote._engine import _forgive_slow_check

    idle = Upstream("http://a")
    assert not _forgive_slow_check(idle, 1.0) and idle.slow_checks == 0
    reloading = Upstream("http://b", reloading=True)
    assert _forgive_slow_check(reloading, 1.0) and reloading.slow_checks == 1
    streaming = Upstream("http://c", outstanding=2, streamed_at=time.monotonic())
    assert _forgive_slow_check(streaming, 1.0)
    stalled = Upstream("http://d", outstanding=2, streamed_at=time.monotonic() - 3600)
    assert not _forgive_slow_check(stalled, 1.0)


def test_a_session_stays_on_its_server_through_a_queue_and_moves_when_it_is_saturated() -> None:
    from stream_gateway.engines._pool import STICKY_SLACK

    p = pool()
    first = p.pick("sess_b")
    first.outstanding = STICKY_SLACK - 1  # a queue, but its cache holds the conversation
    assert p.pick("sess_b") is first and first.picks["sticky"] == 1
    first.outstanding = STICKY_SLACK  # saturated: STICKY_SLACK beyond the idle servers
    moved = p.pick("sess_b")
    assert moved is not first and moved.picks["moved"] == 1
    assert p.pick("sess_b") is moved  # and it stays on its new server
    for upstream in p:
        upstream.outstanding = STICKY_SLACK + 3  # everyone equally busy: nobody is saturated
    assert p.pick("sess_b") is moved
