"""LoRA adapters on the remote engines (docs/engines.md), against the project's own servers: no
real vLLM or SGLang runs here. A ``vllm-http`` gateway is in front of two tiny gateways, whose
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` mirror vLLM's; ``sglang-http`` is in
front of the SGLang stand-in (tests/support/sglang_server.py). The front loads each adapter
version on every upstream as ``NAME@vN``, sends a request only to an upstream holding its current
version, and unloads older versions once idle; every logprob recorded through it is checked
against PEFT's forward pass of base + adapter."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import peft
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.engines.remote import RemoteEngine
from stream_gateway.engines.transformers import TransformersEngine

from ..support.lora import make_adapter
from ..support.servers import RunningGateway, run_gateway, serve_app
from ..support.sglang_server import create_sglang_app
from ..support.waiting import wait_until

ADMIN = "sk-admin"
HEADERS = {"authorization": f"Bearer {ADMIN}"}
CONFIG = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


@dataclass(frozen=True)
class Pool:
    front: RunningGateway
    upstreams: list[RunningGateway]  # two tiny gateways that take adapters
    plain: RunningGateway  # a tiny gateway started without --lora: it refuses every adapter


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapters of tiny: ``boot`` (what the upstreams start with, --lora), alpha's v1 and v2."""
    out = tmp_path_factory.mktemp("remote-adapters")
    return {
        name: make_adapter(tiny_model_path, CONFIG, seed, out / name) for seed, name in enumerate(("boot", "v1", "v2"))
    }


@pytest.fixture(scope="module")
def pool(tiny_model_path: Path, adapter_dirs: dict[str, Path]) -> Iterator[Pool]:
    def upstream(lora: tuple[str, ...]) -> Settings:
        return Settings(
            model=str(tiny_model_path), served_model_name="tiny", lora=lora, admin_api_keys=(ADMIN,), max_batch_size=4
        )

    with ExitStack() as stack:
        started = [upstream((f"boot={adapter_dirs['boot']}",)) for _ in range(2)] + [upstream(())]
        servers = [stack.enter_context(run_gateway(build_engine(s), s)) for s in started]
        front = Settings(
            model=str(tiny_model_path),
            engine="vllm-http",
            served_model_name="tiny",
            upstreams=tuple(s.base_url for s in servers[:2]),
            upstream_api_key=ADMIN,  # an admin key of the upstreams: loading adapters is an admin route
            upstream_health_interval_seconds=0.3,
            upstream_health_timeout_seconds=2.0,
            admin_api_keys=(ADMIN,),
        )
        yield Pool(stack.enter_context(run_gateway(build_engine(front), front)), servers[:2], servers[2])


@pytest.fixture(scope="module")
def references(tiny_model_path: Path, adapter_dirs: dict[str, Path]) -> dict[int, Any]:
    """alpha's versions as PEFT models: the reference forward passes."""
    return {
        version: peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), adapter_dirs[f"v{version}"]
        ).eval()
        for version in (1, 2)
    }


def _post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base_url + path, json=body, headers=HEADERS, timeout=60)


def _load(front: RunningGateway, path: Path, version: int) -> httpx.Response:
    return _post(front.base_url, "/policy/weights", {"adapter": "alpha", "path": str(path), "policy_version": version})


def _models(server: RunningGateway) -> dict[str, Any]:
    listed = httpx.get(server.base_url + "/v1/models", headers=HEADERS, timeout=30).json()["data"]
    return {m["id"]: m.get("policy_version") for m in listed}


def _pool_state(front: RunningGateway) -> dict[str, dict[str, Any]]:
    data = httpx.get(front.base_url + "/admin/upstreams", headers=HEADERS, timeout=30).json()["data"]
    return {u["url"]: u for u in data}


def _served(server: RunningGateway) -> int:
    return int(server.health()["total_requests"])


def _chat(front: RunningGateway, model: str, **options: Any) -> dict[str, Any]:
    """One chat turn through the front in a new session; its recorded turn."""
    session = f"lora{secrets.token_hex(4)}"
    with OpenAI(base_url=f"{front.base_url}/sessions/{session}/v1", api_key=ADMIN, max_retries=0) as client:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me about the sea."}],
            max_tokens=options.pop("max_tokens", 16),
            temperature=1.0,
            **options,
        )
    return _turn(front, session)


def _turn(front: RunningGateway, session: str) -> dict[str, Any]:
    response = httpx.get(f"{front.base_url}/sessions/{session}", headers=HEADERS, timeout=30)
    response.raise_for_status()
    [turn] = response.json()["turns"]
    result: dict[str, Any] = turn
    return result


def _assert_scored_by(model: Any, turn: dict[str, Any]) -> None:
    """The turn's logprobs are the reference model's over its own ids (2e-4)."""
    prompt, output = turn["prompt_ids"], turn["output_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(turn["logprobs"]), expected, atol=2e-4, rtol=0)


def test_the_vllm_lora_routes_of_a_gateway(pool: Pool, adapter_dirs: dict[str, Path]) -> None:
    """A gateway answers vLLM's dynamic LoRA routes as vLLM does (status, error type and message)."""
    server = pool.upstreams[0].base_url
    v1 = str(adapter_dirs["v1"])

    def error(response: httpx.Response, status: int, kind: str, text: str) -> None:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert body["type"] == kind and body["code"] == status and text in body["message"], body

    denied = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": v1})
    assert denied.status_code in (401, 403), denied.text  # an admin route
    error(_post(server, "/v1/load_lora_adapter", {"lora_name": "gamma"}), 400, "InvalidUserInput", "Both")
    nowhere = {"lora_name": "gamma", "lora_path": "/nowhere"}
    error(_post(server, "/v1/load_lora_adapter", nowhere), 404, "NotFoundError", "No adapter found for /nowhere")
    loaded = _post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": v1})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'gamma' added successfully."
    assert _models(pool.upstreams[0])["gamma"] == 0  # a new name is version 0
    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": v1})
    error(again, 400, "InvalidUserInput", "'gamma' has already been loaded")
    inplace = _post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": v1, "load_inplace": True})
    assert inplace.status_code == 200 and _models(pool.upstreams[0])["gamma"] == 1  # its next version
    refused = _post(pool.plain.base_url, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": v1})
    error(refused, 500, "InternalServerError", "unsupported")  # vLLM's answer when its engine refuses one
    unloaded = _post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'gamma' removed successfully."
    assert "gamma" not in _models(pool.upstreams[0])
    error(_post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}), 404, "NotFoundError", "cannot be found")

    # An adapter in use is not unloaded (409): the requests on it would lose it between two steps.
    streaming, release = threading.Event(), threading.Event()

    def stream() -> None:
        with OpenAI(base_url=f"{server}/v1", api_key=ADMIN, max_retries=0) as client:
            chunks = client.completions.create(
                model="boot", prompt="Go on", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
            )
            for i, _ in enumerate(chunks):
                if i == 2:
                    streaming.set()
                    release.wait(60)
                    chunks.close()
                    return

    with ThreadPoolExecutor(1) as executor:
        running = executor.submit(stream)
        assert streaming.wait(60)
        busy = _post(server, "/v1/unload_lora_adapter", {"lora_name": "boot"})
        release.set()
        running.result(60)
    error(busy, 409, "ConflictError", "in use")
    assert "boot" in _models(pool.upstreams[0])


def test_an_adapter_posted_to_the_front_is_loaded_on_every_upstream_as_a_versioned_name(
    pool: Pool, adapter_dirs: dict[str, Path], references: dict[int, Any], tiny_model_path: Path
) -> None:
    loaded = _load(pool.front, adapter_dirs["v1"], 1)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["adapter"] == "alpha" and loaded.json()["policy_version"] == 1
    for upstream in pool.upstreams:
        assert "alpha@v1" in _models(upstream), _models(upstream)  # loaded there under its versioned name
        assert _pool_state(pool.front)[upstream.base_url]["adapters"] == ["alpha@v1"]
    assert _models(pool.front)["alpha"] == 1  # the front lists alpha with its version
    before = [_served(u) for u in pool.upstreams]
    turns = [_chat(pool.front, "alpha") for _ in range(4)]
    assert sum(_served(u) for u in pool.upstreams) - sum(before) == 4
    base_reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for turn in turns:
        assert turn["adapter"] == "alpha" and [tuple(s) for s in turn["policy_versions"]] == [(1, 0)], turn
        _assert_scored_by(references[1], turn)  # base + alpha v1, within 2e-4
    # The adapter makes a difference: the base scores these tokens otherwise.
    with torch.no_grad():
        ids = torch.tensor([turns[0]["prompt_ids"] + turns[0]["output_ids"]])
        assert (references[1](input_ids=ids).logits - base_reference(input_ids=ids).logits).abs().max() > 1e-2


def test_a_new_version_loads_beside_the_old_one_which_is_unloaded_once_idle(
    pool: Pool, adapter_dirs: dict[str, Path], references: dict[int, Any]
) -> None:
    """alpha v1 -> v2 while a long stream runs on v1: the upstream serving it keeps v1 until the
    stream ends (every token of it v1's), the other unloads v1 at once; new requests get v2."""
    session = f"long{secrets.token_hex(4)}"
    streaming, checked = threading.Event(), threading.Event()

    def stream() -> None:
        with OpenAI(base_url=f"{pool.front.base_url}/sessions/{session}/v1", api_key=ADMIN, max_retries=0) as client:
            chunks = client.chat.completions.create(
                model="alpha",
                messages=[{"role": "user", "content": "Go on and on."}],
                max_tokens=1500,
                temperature=1.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i, _ in enumerate(chunks):
                if i == 2:
                    streaming.set()
                    checked.wait(60)

    with ThreadPoolExecutor(1) as executor:
        running = executor.submit(stream)
        assert streaming.wait(60)
        loaded = _load(pool.front, adapter_dirs["v2"], 2)
        state = _pool_state(pool.front)
        checked.set()
        running.result(120)
    assert loaded.status_code == 200 and loaded.json()["previous_version"] == 1, loaded.text
    serving = [url for url, u in state.items() if u["adapter_requests"].get("alpha@v1")]
    assert len(serving) == 1, state  # the stream was still in flight on one upstream
    assert state[serving[0]]["adapters"] == ["alpha@v1", "alpha@v2"], state
    # Every token of the long turn is v1's: its upstream kept alpha@v1 for it.
    turn = _turn(pool.front, session)
    assert len(turn["output_ids"]) == 1500 and [tuple(s) for s in turn["policy_versions"]] == [(1, 0)]
    _assert_scored_by(references[1], turn)
    # Idle now: v1 is unloaded everywhere, on the servers themselves too.
    wait_until(lambda: all(u["adapters"] == ["alpha@v2"] for u in _pool_state(pool.front).values()), "v1 unloaded")
    for upstream in pool.upstreams:
        models = _models(upstream)
        assert "alpha@v2" in models and "alpha@v1" not in models, models
    turn = _chat(pool.front, "alpha")
    assert [tuple(s) for s in turn["policy_versions"]] == [(2, 0)]
    _assert_scored_by(references[2], turn)
    stale = _load(pool.front, adapter_dirs["v1"], 2)
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_policy_version", stale.text


def test_an_upstream_that_cannot_load_the_adapter_takes_none_of_its_requests(
    pool: Pool, references: dict[int, Any]
) -> None:
    """A server added to the pool is given the current adapters; one that refuses them (started
    without --lora) serves no request on them. With no server holding it, a clear 503."""
    front, plain = pool.front, pool.plain.base_url
    added = _post(front.base_url, "/admin/upstreams", {"add": [plain]}).json()
    [entry] = [u for u in added["data"] if u["url"] == plain]
    assert entry["healthy"] and entry["adapters"] == [], entry
    assert "unsupported" in entry["adapter_failures"]["alpha@v2"], entry  # refused: its engine has no LoRA
    try:
        before = _served(pool.plain)
        turns = [_chat(front, "alpha") for _ in range(6)]
        assert _served(pool.plain) == before  # none of alpha's requests went there
        for turn in turns:
            _assert_scored_by(references[2], turn)
        # Only the server without LoRA left: alpha is unavailable, the base model is not.
        urls = [u.base_url for u in pool.upstreams]
        _post(front.base_url, "/admin/upstreams", {"remove": urls})
        response = httpx.post(
            f"{front.base_url}/v1/chat/completions",
            headers=HEADERS,
            json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert response.status_code == 503, response.text
        assert "No healthy inference server holds the LoRA adapter alpha@v2" in response.json()["error"]["message"]
        assert _chat(front, "tiny", max_tokens=4)["adapter"] is None
        # Back in the pool: they still hold alpha@v2 ("already loaded" counts as held) and serve it.
        readded = _post(front.base_url, "/admin/upstreams", {"add": urls}).json()
        assert all(u["adapters"] == ["alpha@v2"] for u in readded["data"] if u["url"] in urls), readded
        _assert_scored_by(references[2], _chat(front, "alpha"))
    finally:
        _post(front.base_url, "/admin/upstreams", {"remove": [plain], "add": [u.base_url for u in pool.upstreams]})


def test_sglang_http_loads_adapters_on_its_servers(
    tiny_model_path: Path, adapter_dirs: dict[str, Path], references: dict[int, Any]
) -> None:
    """The same through SGLang's protocol (the stand-in): /load_lora_adapter, ``lora_path`` on
    /generate, the old version unloaded; a server that lost the adapter gets it again."""
    engine = TransformersEngine(tiny_model_path, served_model_name="tiny", loras={"boot": str(adapter_dirs["boot"])})
    with serve_app(create_sglang_app(engine)) as sglang:
        settings = Settings(
            model=str(tiny_model_path),
            engine="sglang-http",
            served_model_name="tiny",
            upstreams=(sglang,),
            upstream_health_interval_seconds=0.3,
            admin_api_keys=(ADMIN,),
        )
        with run_gateway(build_engine(settings), settings) as front:
            assert isinstance(front.engine, RemoteEngine)
            assert _load(front, adapter_dirs["v1"], 1).status_code == 200
            assert set(engine.adapters) == {"boot", "alpha@v1"}
            _assert_scored_by(references[1], _chat(front, "alpha"))
            assert _load(front, adapter_dirs["v2"], 2).status_code == 200
            wait_until(lambda: set(engine.adapters) == {"boot", "alpha@v2"}, "alpha@v1 unloaded from the stand-in")
            turn = _chat(front, "alpha")
            assert [tuple(s) for s in turn["policy_versions"]] == [(2, 0)]
            _assert_scored_by(references[2], turn)
            # Unloaded behind the front's back (a restarted server): the next request learns it
            # (SGLang's error frame), and the server is given the adapter again.
            gone = httpx.post(sglang + "/unload_lora_adapter", json={"lora_name": "alpha@v2"}, timeout=30)
            assert gone.status_code == 200 and gone.json()["success"], gone.text
            lost = httpx.post(
                f"{front.base_url}/v1/chat/completions",
                headers=HEADERS,
                json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=60,
            )
            assert lost.status_code == 503, lost.text
            wait_until(lambda: "alpha@v2" in engine.adapters, "alpha@v2 loaded again")
            _assert_scored_by(references[2], _chat(front, "alpha"))
