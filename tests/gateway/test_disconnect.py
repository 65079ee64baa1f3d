"""A client that goes away mid-response aborts its engine request promptly."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from ..support.servers import RunningGateway

BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me everything."}],
    "max_tokens": 100_000,
    "ignore_eos": True,
}


def _wait_until_idle(gateway: RunningGateway, timeout: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        health = gateway.health()
        if health["active_requests"] == 0 and health["waiting_requests"] == 0:
            return health
        assert time.monotonic() < deadline, f"engine request still running: {health}"
        time.sleep(0.02)


def _tokens(gateway: RunningGateway) -> int:
    value = gateway.health()["total_generated_tokens"]
    assert isinstance(value, int)
    return value


def test_stream_disconnect_aborts_the_engine_request(gateway: RunningGateway) -> None:
    before = _tokens(gateway)
    with httpx.stream(
        "POST", gateway.base_url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30
    ) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert gateway.health()["active_requests"] == 1
    assert any('"content"' in line for line in received)
    _wait_until_idle(gateway)
    generated = _tokens(gateway) - before
    # The request asked for 100k tokens; it was cut off after a handful.
    assert generated < 5_000
    time.sleep(0.3)
    assert _tokens(gateway) - before == generated, "tokens were still sampled after the abort"


def test_openai_client_closing_a_stream_aborts(client: OpenAI, gateway: RunningGateway) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=BODY["messages"], max_tokens=100_000, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    _wait_until_idle(gateway)


def test_non_streaming_disconnect_aborts(gateway: RunningGateway) -> None:
    with httpx.Client(timeout=0.5) as c:
        try:
            c.post(gateway.base_url + "/v1/chat/completions", json=BODY)
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("100k tokens cannot finish in half a second")
    _wait_until_idle(gateway)


def _metric(gateway: RunningGateway, name: str) -> float:
    text = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def _aborted(gateway: RunningGateway) -> float:
    """``gateway_aborted_requests_total`` now."""
    return _metric(gateway, "gateway_aborted_requests_total")


def _settled(gateway: RunningGateway, timeout: float = 10.0) -> None:
    """No engine request and no response in progress: the abort counter is final (a response counts
    its abort in the same ``finally`` that takes it off ``gateway_active_streams``)."""
    _wait_until_idle(gateway, timeout)
    deadline = time.monotonic() + timeout
    while (active := _metric(gateway, "gateway_active_streams")) > 0:
        assert time.monotonic() < deadline, f"responses still in progress: {active}"
        time.sleep(0.02)


def _aborted_reaches(gateway: RunningGateway, expected: float, timeout: float = 10.0) -> None:
    """The counter reaches ``expected`` (the server counts once it sees the client gone), and stays."""
    deadline = time.monotonic() + timeout
    while (value := _aborted(gateway)) < expected:
        assert time.monotonic() < deadline, f"aborted requests: {value}, expected {expected}"
        time.sleep(0.02)
    _settled(gateway)
    assert _aborted(gateway) == expected, "an aborted request was counted more than once"


def test_aborted_requests_are_counted(gateway: RunningGateway) -> None:
    # The counter is the shared gateway's: what earlier tests left there is the baseline.
    _settled(gateway)
    before = _aborted(gateway)

    # Answers that run to their end are not aborts, streamed or not.
    short = {**BODY, "max_tokens": 3}
    finished = httpx.post(gateway.base_url + "/v1/chat/completions", json=short, timeout=60)
    assert finished.status_code == 200, finished.text
    with httpx.stream(
        "POST", gateway.base_url + "/v1/chat/completions", json={**short, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.read().rstrip().endswith(b"data: [DONE]")
    _settled(gateway)
    assert _aborted(gateway) == before

    # A stream the client leaves: one abort.
    with httpx.stream(
        "POST", gateway.base_url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30
    ) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    _aborted_reaches(gateway, before + 1)

    # A non-streamed answer the client stops waiting for: another.
    with httpx.Client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post(gateway.base_url + "/v1/chat/completions", json=BODY)
    _aborted_reaches(gateway, before + 2)
