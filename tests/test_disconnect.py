"""A client that goes away mid-response aborts its engine request promptly."""

from __future__ import annotations

import time

import httpx
from openai import OpenAI

from .servers import RunningGateway

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


def test_aborted_requests_are_counted(gateway: RunningGateway) -> None:
    text = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith("gateway_aborted_requests_total"))
    assert float(line.split()[-1]) >= 1
