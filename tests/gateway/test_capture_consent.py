"""Capture consent on a real gateway capturing into a real nats-server (docs/data-rights.md).

A tenant whose key says ``capture=off``, and a request saying ``X-Capture: off``, are served as
usual (streamed tokens, sessions that continue, ``GET /sessions/{id}``) and nothing of them
leaves the process: no event, no shared session record, no outbox file. A scan of every stream
(events, the sessions bucket, the images store) and of the outbox directory finds neither their
session ids nor their token ids, while the same scan finds a captured session's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import tenant_id
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import of_session, wait_for
from ..support.servers import RunningGateway, run_gateway
from ..support.traces import file_traces, ids_text, nats_traces

KEYS = """\
sk-open     open
sk-private  private  capture=off
sk-strict   strict   capture=on
"""


@pytest.fixture(scope="module")
def consent(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningGateway, str, Path]]:
    root = tmp_path_factory.mktemp("consent")
    (root / "keys.txt").write_text(KEYS)
    with EmbeddedNatsServer() as nats:
        settings = Settings(
            model=str(tiny_model_path),
            served_model_name="tiny",
            nats_url=nats.url,
            outbox_dir=root / "outbox",
            api_key_file=root / "keys.txt",
            shared_sessions=True,
        )
        with run_gateway(build_engine(settings), settings) as running:
            yield running, nats.url, root / "outbox"


def _client(gateway: RunningGateway, key: str, capture: str | None = None) -> OpenAI:
    headers = {"x-capture": capture} if capture is not None else None
    return OpenAI(base_url=gateway.base_url + "/v1", api_key=key, default_headers=headers, max_retries=0)


def _conversation(client: OpenAI, marker: str) -> tuple[str, str]:
    """Two streamed turns, the second continuing the first; the session id and the capture header."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"hello {marker}"}]
    session_ids, captures = set(), set()
    for follow_up in ("and then?", None):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=6, stream=True  # type: ignore[arg-type]
        )
        session_ids.add(raw.headers["x-session-id"])
        captures.add(raw.headers["x-capture"])
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        assert text, "a normal stream: tokens arrive"
        if follow_up is not None:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    assert len(session_ids) == 1 and len(captures) == 1, (session_ids, captures)
    return session_ids.pop(), captures.pop()


def _session(gateway: RunningGateway, key: str, session_id: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session_id}", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _needles(body: dict[str, Any]) -> list[bytes]:
    """Its id, and its first prompt's token ids (which hold the conversation's marker: the tiny
    model's replies, and the follow-up's template, are alike in every conversation)."""
    return [body["session_id"].encode(), ids_text(body["turns"][0]["prompt_ids"])]


def _uncaptured(gateway: RunningGateway) -> dict[str, float]:
    text = httpx.get(gateway.base_url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("gateway_uncaptured_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


def test_capture_off_tenants_and_requests_leave_nothing_in_nats_or_on_disk(
    consent: tuple[RunningGateway, str, Path],
) -> None:
    gateway, url, outbox = consent
    captured_id, capture = _conversation(_client(gateway, "sk-open"), "captured")
    assert capture == "on"
    private_id, capture = _conversation(_client(gateway, "sk-private"), "private")
    assert capture == "off"
    asked_id, capture = _conversation(_client(gateway, "sk-open", "off"), "asked")
    assert capture == "off"
    # A tenant's refusal holds even against a request asking to be captured.
    overridden_id, capture = _conversation(_client(gateway, "sk-private", "on"), "overridden")
    assert capture == "off"

    # The captured conversation reached NATS (events and the sessions bucket): the scan works.
    wait_for(url, lambda es: sum(e.kind == "turn.completed" for e in of_session(es, captured_id)) == 2)
    captured = _session(gateway, "sk-open", captured_id)
    assert len(captured["turns"]) == 2 and captured["turns"][1]["parent_id"] == captured["turns"][0]["turn_id"]
    deadline = time.monotonic() + 30
    while not any(t.startswith("KV_") for t in nats_traces(url, [captured_id.encode()])):
        assert time.monotonic() < deadline, "the captured session's shared record never appeared"
        time.sleep(0.2)
    assert any(t.startswith("SG_EVENTS") for t in nats_traces(url, _needles(captured)))

    for key, session_id in (("sk-private", private_id), ("sk-open", asked_id), ("sk-private", overridden_id)):
        body = _session(gateway, key, session_id)  # served from this replica's memory
        assert len(body["turns"]) == 2 and body["turns"][1]["parent_id"] == body["turns"][0]["turn_id"]
        needles = _needles(body)
        assert nats_traces(url, needles) == [], session_id
        assert file_traces(outbox, needles) == [], session_id
    assert nats_traces(url, [tenant_id("private").encode()]) == []
    assert _uncaptured(gateway) == {"tenant": 4.0, "request": 2.0}


def test_capture_off_never_joins_a_captured_conversation(consent: tuple[RunningGateway, str, Path]) -> None:
    gateway, url, _ = consent
    messages: list[dict[str, Any]] = [{"role": "user", "content": "one conversation"}]
    first = _client(gateway, "sk-open").chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=4  # type: ignore[arg-type]
    )
    session_id = first.headers["x-session-id"]
    messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                 {"role": "user", "content": "go on"}]  # fmt: skip
    # The same conversation continued with capture off: a session of its own, not the captured one.
    second = _client(gateway, "sk-open", "off").chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=4  # type: ignore[arg-type]
    )
    assert second.headers["x-session-id"] != session_id
    assert len(_session(gateway, "sk-open", session_id)["turns"]) == 1
    # Naming the captured session with capture off (or an uncaptured one with capture on): 409.
    for key, capture, name in (("sk-open", "off", session_id), ("sk-open", None, second.headers["x-session-id"])):
        response = httpx.post(
            f"{gateway.base_url}/sessions/{name}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 2},
            headers={"authorization": f"Bearer {key}", **({"x-capture": capture} if capture else {})},
        )
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "session_capture_mismatch"


def test_a_tenant_that_requires_capture_refuses_capture_off_and_bad_values_are_400(
    consent: tuple[RunningGateway, str, Path],
) -> None:
    gateway, _, _ = consent
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = gateway.base_url + "/v1/chat/completions"
    refused = httpx.post(url, json=body, headers={"authorization": "Bearer sk-strict", "x-capture": "off"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert "capture=on" in refused.json()["error"]["message"]
    served = httpx.post(url, json=body, headers={"authorization": "Bearer sk-strict"}, timeout=60)
    assert served.status_code == 200 and served.headers["x-capture"] == "on"
    bad = httpx.post(url, json=body, headers={"authorization": "Bearer sk-open", "x-capture": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-capture"
