"""LoRA adapters over NATS: ``publish-weights --adapter NAME`` reaches every gateway replica.

Real parts throughout: a nats-server of this module's own, PEFT adapters of the tiny model (made by
PEFT, ``lora_B`` drawn at random since PEFT starts it at zero), in-process gateways on the
transformers engine (two running, one started late) and one on the synthetic engine (no LoRA), the
``stream-gateway publish-weights`` command and :func:`pipeline.policies.publish_policy`.

The publish -> applied latency of every replica (time from the publish call returning, the event
being acked, to the replica's ``engine.adapters`` showing the version) is printed (``pytest -s``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from openai import OpenAI

from pipeline.embedded import EmbeddedNatsServer
from pipeline.errors import StalePolicyVersion
from pipeline.events import PolicyApplied, PolicyRejected, PolicyUpdated
from pipeline.policies import POLICY_BUCKET, publish_policy
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import read_stream
from ..support.lora import make_adapter, mis_shaped
from ..support.servers import RunningGateway, run_gateway
from ..support.waiting import wait_until

ALPHA = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
BETA = {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "o_proj"]}


@pytest.fixture(scope="module")
def adapter_nats() -> Iterator[EmbeddedNatsServer]:
    """A nats-server for this module only (other modules' gateways follow their own)."""
    with EmbeddedNatsServer() as server:
        yield server


def _publish(url: str, directory: Path, version: int, adapter: str) -> PolicyUpdated:
    async def run() -> PolicyUpdated:
        nc = await nats.connect(url)
        try:
            return await publish_policy(nc, directory, version, adapter=adapter)
        finally:
            await nc.close()

    return anyio.run(run)


def _cli(url: str, directory: Path, version: int, adapter: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "stream_stack", "publish-weights", "--nats-url", url, "--adapter", adapter]
    return subprocess.run([*command, "--policy-version", str(version), str(directory)], capture_output=True, text=True)


@contextmanager
def _watch(replicas: dict[str, RunningGateway], adapter: str, version: int) -> Iterator[dict[str, float]]:
    """While the block runs and after it, until every replica's engine serves ``version`` of
    ``adapter``: the wall-clock time (``time.time()``) each first did (polled every millisecond)."""
    seen: dict[str, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while len(seen) < len(replicas) and not stop.is_set():
            for name, gateway in replicas.items():
                if name not in seen and gateway.engine.adapters.get(adapter) == version:
                    seen[name] = time.time()
            time.sleep(0.001)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
        thread.join(timeout=120)
        assert len(seen) == len(replicas), f"{adapter} {version}: applied only on {sorted(seen)}"
    finally:
        stop.set()
        thread.join()


def _events(url: str, kind: type[Any], adapter: str | None = None) -> list[Any]:
    return [e for _, e in read_stream(url) if isinstance(e, kind) and (adapter is None or e.adapter == adapter)]


def test_adapters_published_on_nats_reach_every_replica_and_late_ones_catch_up(
    adapter_nats: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    url = adapter_nats.url
    alpha = {v: make_adapter(tiny_model_path, ALPHA, v, tmp_path / f"alpha-{v}") for v in (0, 1, 3)}
    beta = make_adapter(tiny_model_path, BETA, 11, tmp_path / "beta-1")
    bad = mis_shaped(alpha[1], tmp_path / "alpha-bad")
    latencies: list[tuple[str, PolicyUpdated, float, dict[str, float]]] = []  # what, event, publish call, applied

    def settings(replica: str, engine: str = "transformers") -> Settings:
        return Settings(
            model=str(tiny_model_path),
            served_model_name="tiny",
            engine=engine,
            lora=(f"alpha={alpha[0]}",) if engine == "transformers" else (),
            synthetic_tokens_per_second=0,
            nats_url=url,
            outbox_dir=tmp_path / f"outbox-{replica}",
            replica_id=replica,
        )

    def start(stack: ExitStack, replica: str, engine: str = "transformers") -> RunningGateway:
        config = settings(replica, engine)
        return stack.enter_context(run_gateway(build_engine(config), config))

    with ExitStack() as stack:
        g1, g2, gs = start(stack, "g1"), start(stack, "g2"), start(stack, "gs", "synthetic")
        running = {"g1": g1, "g2": g2}
        assert dict(g1.engine.adapters) == dict(g2.engine.adapters) == {"alpha": 0}

        # alpha v1 from Python: both replicas apply it; the synthetic engine says it cannot.
        with _watch(running, "alpha", 1) as seen:
            called = time.time()
            event = _publish(url, alpha[1], 1, "alpha")
        latencies.append(("alpha v1, publish_policy", event, called, seen))
        assert event.adapter == "alpha" and [o.name.rsplit("/", 1)[-1] for o in event.objects] == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]

        # beta v1 with the command: a new adapter, created at run time on both.
        with _watch(running, "beta", 1) as seen:
            called = time.time()
            result = _cli(url, beta, 1, "beta")
            assert result.returncode == 0, result.stderr
        (event,) = [e for e in _events(url, PolicyUpdated) if e.adapter == "beta"]
        latencies.append(("beta v1 (new), publish-weights command", event, called, seen))

        # A stale version is refused by the publisher, nothing is announced.
        updates = len(_events(url, PolicyUpdated))
        with pytest.raises(StalePolicyVersion, match="not above 1"):
            _publish(url, alpha[3], 1, "alpha")
        stale = _cli(url, beta, 1, "beta")
        assert stale.returncode == 2 and "version 1 is not above 1, the newest published" in stale.stderr
        assert len(_events(url, PolicyUpdated)) == updates

        # A mis-shaped alpha v2: both refuse it and keep serving v1.
        _publish(url, bad, 2, "alpha")

        def refused(replicas: tuple[str, ...], version: int) -> dict[str, PolicyRejected]:
            events = {e.replica: e for e in _events(url, PolicyRejected, "alpha") if e.rejected_version == version}
            return {r: events[r] for r in replicas if r in events}

        wait_until(lambda: len(refused(("g1", "g2", "gs"), 2)) == 3, "every replica to refuse alpha v2", timeout=120)
        for replica, rejection in refused(("g1", "g2"), 2).items():
            assert (rejection.reason, rejection.policy_version) == ("shape_mismatch", 1), (replica, rejection)
        assert dict(g1.engine.adapters) == dict(g2.engine.adapters) == {"alpha": 1, "beta": 1}

        # A replica started now: its newest valid alpha (v1, after refusing v2) and beta, which it never saw.
        g3 = start(stack, "g3")
        assert dict(g3.engine.adapters) == {"alpha": 1, "beta": 1}
        assert refused(("g3",), 2)["g3"].reason == "shape_mismatch"
        running["g3"] = g3

        # alpha v3: all three apply it.
        with _watch(running, "alpha", 3) as seen:
            called = time.time()
            event = _publish(url, alpha[3], 3, "alpha")
        latencies.append(("alpha v3, publish_policy", event, called, seen))
        for gateway in (g1, g2, g3):
            assert dict(gateway.engine.adapters) == {"alpha": 3, "beta": 1}
            for model in ("alpha", "beta", "tiny"):
                reply = OpenAI(base_url=gateway.base_url + "/v1", api_key="k", max_retries=0).chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                assert reply.choices[0].finish_reason in ("stop", "length")
        assert gs.engine.adapters == {} and gs.engine.policy_version == 0
        wait_until(lambda: len(refused(("gs",), 3)) == 1, "the synthetic replica to refuse alpha v3", timeout=120)

    applied = [e for e in _events(url, PolicyApplied) if e.adapter is not None]
    assert sorted((e.replica, e.adapter, e.previous_version, e.policy_version) for e in applied) == [
        ("g1", "alpha", 0, 1), ("g1", "alpha", 1, 3), ("g1", "beta", 0, 1),
        ("g2", "alpha", 0, 1), ("g2", "alpha", 1, 3), ("g2", "beta", 0, 1),
        ("g3", "alpha", 0, 1), ("g3", "alpha", 1, 3), ("g3", "beta", 0, 1),
    ]  # fmt: skip
    assert all(e.source == "nats" and e.download_s > 0 and e.pause_s > 0 and e.tensors > 0 for e in applied)
    unsupported = [e for e in _events(url, PolicyRejected) if e.replica == "gs"]
    assert {(e.adapter, e.rejected_version) for e in unsupported} == {
        ("alpha", 1),
        ("beta", 1),
        ("alpha", 2),
        ("alpha", 3),
    }
    assert all(e.reason == "unsupported" for e in unsupported)
    assert not [e for e in _events(url, PolicyApplied) if e.adapter is None]  # the base was never touched

    # The bucket keeps the two newest versions of each adapter (--keep 2).
    assert sorted({name.rsplit("/", 1)[0] for name in anyio.run(_object_names, url)}) == [
        "adapters/alpha/v0000000002",
        "adapters/alpha/v0000000003",
        "adapters/beta/v0000000001",
    ]
    _report(latencies, applied)


async def _object_names(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        store = await nc.jetstream().object_store(POLICY_BUCKET)
        return [info.name for info in await store.list() if not info.deleted]
    finally:
        await nc.close()


def _report(latencies: list[tuple[str, PolicyUpdated, float, dict[str, float]]], applied: list[PolicyApplied]) -> None:
    """Print the publish -> applied latency of every replica (``pytest -s`` shows it)."""
    by_replica = {(e.replica, e.adapter, e.policy_version): e for e in applied}
    print("\npublish -> applied: from the publish call (upload + announce) and from the announced event")
    print("(policy.updated stamped) to each replica's engine.adapters showing the version; the replica's")
    print("own policy.applied timings in brackets")
    for label, update, called, seen in latencies:
        print(f"  {label} (upload + announce {(update.time - called) * 1e3:.0f} ms):")
        for replica, at in sorted(seen.items()):
            mine = by_replica[(replica, update.adapter, update.policy_version)]
            print(
                f"    {replica}: {(at - called) * 1e3:6.1f} ms from the call, {(at - update.time) * 1e3:6.1f} ms "
                f"from the event [download {mine.download_s * 1e3:.1f} ms, apply {mine.apply_s * 1e3:.1f} ms, "
                f"decoding paused {mine.pause_s * 1e3:.2f} ms]"
            )
        assert all(at >= update.time for at in seen.values())


def test_a_replica_continues_an_adapter_session_with_its_adapter(tiny_model_path: Path, tmp_path: Path) -> None:
    """Turn 1 on replica a names adapter alpha; turn 2 reaches replica b naming the base model: b
    learns the session (and its adapter) from the stream, continues the chain on alpha, and its
    logprobs are base + alpha's (PEFT)."""
    import httpx
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    config = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    alpha = make_adapter(tiny_model_path, config, 11, tmp_path / "alpha")
    session = "replicated-alpha"
    with EmbeddedNatsServer() as server, ExitStack() as stack:
        replicas = []
        for name in ("a", "b"):
            settings = Settings(
                model=str(tiny_model_path),
                served_model_name="tiny",
                lora=(f"alpha={alpha}",),
                nats_url=server.url,
                outbox_dir=tmp_path / f"outbox-{name}",
                replica_id=name,
            )
            replicas.append(stack.enter_context(run_gateway(build_engine(settings), settings)))
        messages: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
        for gateway, model in zip(replicas, ("alpha", "tiny"), strict=True):
            with OpenAI(base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key="sk-r", max_retries=0) as client:
                reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "More."},
            ]
        headers = {"authorization": "Bearer sk-r"}
        turns = httpx.get(f"{replicas[1].base_url}/sessions/{session}", headers=headers).json()["turns"]
    assert len(turns) == 2 and turns[1]["parent_id"] == turns[0]["turn_id"]
    assert [t["adapter"] for t in turns] == ["alpha", "alpha"]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), alpha).eval()
    prompt, output = turns[1]["prompt_ids"], turns[1]["output_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(turns[1]["logprobs"]), expected, atol=2e-4, rtol=0)
