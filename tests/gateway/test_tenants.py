"""Keys, tenants and per-tenant limits on a real gateway (synthetic engine, paced so that
requests overlap), and the official openai client retrying a 429 by its Retry-After."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from stream_gateway import Settings
from stream_gateway.cli import main
from stream_gateway.control._tenants import KeyRing, Limits, read_key_file
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, run_gateway
from .test_conformance import check

KEY_FILE = """\
# key            tenant   limits
sk-alice-laptop  alice    concurrency=1
sk-alice-ci      alice    concurrency=1
sk-bob           bob      rpm=2
sk-carol         carol    tpm=40
sk-dave          dave     sessions=1
sk-erin          erin     rpm=2
"""


@pytest.fixture(scope="module")
def keyed_gateway(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY_FILE)
    settings = Settings(
        model=str(tiny_model_path),
        engine="synthetic",
        served_model_name="synthetic",
        synthetic_tokens_per_second=40,
        api_key_file=path,
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _chat(gateway: RunningGateway, key: str, *, tokens: int = 2, session: str | None = None) -> httpx.Response:
    url = f"{gateway.base_url}/sessions/{session}/v1" if session else f"{gateway.base_url}/v1"
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    return httpx.post(url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _assert_429(response: httpx.Response, kind: str = "requests") -> int:
    assert response.status_code == 429, response.text
    body = response.json()
    check(body, "ErrorResponse")
    assert (body["error"]["code"], body["error"]["type"]) == ("rate_limit_exceeded", kind)
    retry_after = int(response.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def test_keys_of_one_tenant_share_its_sessions(keyed_gateway: RunningGateway) -> None:
    assert _chat(keyed_gateway, "sk-unknown").status_code == 401
    assert _chat(keyed_gateway, "sk-alice-laptop", session="shared-a").status_code == 200
    get = lambda key: httpx.get(  # noqa: E731
        f"{keyed_gateway.base_url}/sessions/shared-a", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert get("sk-alice-ci").status_code == 200  # the same tenant, another key
    assert get("sk-bob").status_code == 404  # another tenant: as an id nobody used (issue 55)
    metrics = httpx.get(f"{keyed_gateway.base_url}/metrics", timeout=30).text
    assert "sk-alice" not in metrics and "alice" not in metrics


def test_concurrency_limit_and_the_openai_client_retrying(keyed_gateway: RunningGateway) -> None:
    # One streamed request of ~1.5 s holds alice's only slot, whichever of her keys asks next.
    holder = threading.Thread(target=_chat, args=(keyed_gateway, "sk-alice-laptop"), kwargs={"tokens": 60})
    holder.start()
    try:
        for _ in range(100):  # until the holder is admitted
            metrics = httpx.get(f"{keyed_gateway.base_url}/metrics", timeout=30).text
            if "gateway_active_streams 1.0" in metrics or _busy(keyed_gateway):
                break
        _assert_429(_chat(keyed_gateway, "sk-alice-ci"))
        assert _chat(keyed_gateway, "sk-bob").status_code == 200  # other tenants are not held up
        # The official client honours Retry-After and gets through once the slot is free.
        with OpenAI(base_url=keyed_gateway.base_url + "/v1", api_key="sk-alice-ci", max_retries=5, timeout=60) as c:
            reply = c.chat.completions.create(
                model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert reply.choices[0].finish_reason == "length"
        # ...after being refused at least once itself (the holder streams for ~1.5 s).
        assert _refusals(keyed_gateway) >= 2
    finally:
        holder.join(60)


def _refusals(gateway: RunningGateway) -> float:
    metrics = httpx.get(f"{gateway.base_url}/metrics", timeout=30).text
    lines = [line for line in metrics.splitlines() if line.startswith("gateway_requests_total") and '"429"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _busy(gateway: RunningGateway) -> bool:
    health: dict[str, Any] = httpx.get(f"{gateway.base_url}/health", timeout=30).json()
    return bool(health.get("active_requests"))


def test_requests_tokens_and_sessions_per_minute(keyed_gateway: RunningGateway) -> None:
    assert [_chat(keyed_gateway, "sk-erin").status_code for _ in range(2)] == [200, 200]
    assert 1 <= _assert_429(_chat(keyed_gateway, "sk-erin")) <= 60  # 2 a minute: one back in ~30 s
    # carol: 40 tokens a minute; a request's prompt (~20 tokens) and 30 completion tokens spend them.
    assert _chat(keyed_gateway, "sk-carol", tokens=30).status_code == 200
    _assert_429(_chat(keyed_gateway, "sk-carol"), kind="tokens")
    # dave: one open session; closing it makes room for another.
    assert _chat(keyed_gateway, "sk-dave", session="dave-1").status_code == 200
    _assert_429(_chat(keyed_gateway, "sk-dave", session="dave-2"))
    assert _chat(keyed_gateway, "sk-dave", session="dave-1").status_code == 200  # the open one goes on
    closed = httpx.post(
        f"{keyed_gateway.base_url}/sessions/dave-1/close", headers={"Authorization": "Bearer sk-dave"}, timeout=30
    )
    assert closed.status_code == 200
    assert _chat(keyed_gateway, "sk-dave", session="dave-2").status_code == 200


def test_key_file_reload_keeps_the_old_keys_when_the_new_file_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("k1 team-a concurrency=2\n")
    ring = KeyRing((), path, Limits(rpm=100))
    entry = ring.entry("k1")
    assert entry is not None and entry.tenant == "team-a" and entry.limits == Limits(concurrency=2, rpm=100)
    assert ring.entry("k2") is None
    path.write_text("k2 team-b\n")
    ring.reload()
    assert ring.entry("k1") is None and ring.entry("k2") is not None
    path.write_text("k3 team-c bogus=1\n")
    ring.reload()  # refused, logged: k2 stays
    assert ring.entry("k2") is not None and ring.entry("k3") is None
    with pytest.raises(ValueError, match=r"keys\.txt:1: bad limit"):
        read_key_file(path)


def test_capture_in_the_key_file_holds_for_every_key_of_its_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("k1 private capture=off\nk2 private rpm=5\nk3 strict capture=on\nk4 open\n")
    keys = read_key_file(path)
    assert [keys[k].capture for k in ("k1", "k2", "k3", "k4")] == [False, False, True, None]
    path.write_text("k1 private capture=off\nk2 private capture=on\n")
    with pytest.raises(ValueError, match=r"keys\.txt:2: another key of tenant 'private' says capture=off"):
        read_key_file(path)
    path.write_text("k1 private capture=no\n")
    with pytest.raises(ValueError, match=r"keys\.txt:1: capture= is on or off, not 'no'"):
        read_key_file(path)


def test_no_keys_on_a_public_address_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "--engine", "synthetic", "--host", "0.0.0.0"]) == 2
    assert "--allow-anonymous" in capsys.readouterr().err
    bad = tmp_path / "keys.txt"
    bad.write_text("only-a-key\n")
    assert main(["serve", "--engine", "synthetic", "--api-key-file", str(bad)]) == 2
    assert "keys.txt:1" in capsys.readouterr().err
