"""The online loop's return path: policies published on NATS reach every gateway, mid-stream.

Real parts throughout: a nats-server of this module's own (published policies must not leak into
other tests' gateways, which follow the stream too), gateways serving the tiny model (in a thread
for the in-flight test, as separate ``stream-gateway serve`` processes for the replica test), the
official ``openai`` client, and fp32 forward passes of each version's weights as the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import nats
import pytest
import torch
from openai import OpenAI
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from consumers.trajectories import SessionEvents, build_trajectories
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import PolicyApplied, PolicyRejected, PolicyUpdated, TurnCompleted
from pipeline.policies import POLICY_BUCKET, publish_policy
from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.capture import read_stream
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import free_port, run_gateway, wait_healthy
from ..support.waiting import wait_until


@pytest.fixture(scope="module")
def policy_nats() -> Iterator[EmbeddedNatsServer]:
    """A nats-server for this module only."""
    with EmbeddedNatsServer() as server:
        yield server


def _state(model_path: Path, seed: int | None) -> dict[str, torch.Tensor]:
    """The tiny model's weights, perturbed by ``seed`` (``None``: as built). Tied weights once."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    return state


def _save(state: dict[str, torch.Tensor], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return directory


def _model_with(model_path: Path, state: dict[str, torch.Tensor]) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    return model.eval()


def _publish(url: str, directory: Path, version: int, **options: Any) -> PolicyUpdated:
    async def run() -> PolicyUpdated:
        nc = await nats.connect(url)
        try:
            return await publish_policy(nc, directory, version, **options)
        finally:
            await nc.close()

    return anyio.run(run)


def _version(base_url: str) -> int:
    return int(httpx.get(base_url + "/health", timeout=10).json()["policy_version"])


def test_a_stream_in_flight_crosses_two_published_updates(
    policy_nats: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    """No error, no abort; three spans; every token's logprob is its own version's forward pass."""
    states = {0: _state(tiny_model_path, None), 1: _state(tiny_model_path, 1), 2: _state(tiny_model_path, 2)}
    directories = {v: _save(states[v], tmp_path / f"v{v}") for v in (1, 2)}
    settings = Settings(
        model=str(tiny_model_path),
        served_model_name="tiny",
        nats_url=policy_nats.url,
        outbox_dir=tmp_path / "outbox",
        replica_id="inflight",
    )
    with run_gateway(build_engine(settings), settings) as gateway:
        session_id = "sess-inflight"
        client = OpenAI(base_url=f"{gateway.base_url}/sessions/{session_id}/v1", api_key="k", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Count to a thousand."}],
            stream=True,
            max_tokens=3000,
            temperature=1.0,
            seed=7,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        chunks = [next(stream)]  # the role chunk: the request is decoding
        for version in (1, 2):
            _publish(policy_nats.url, directories[version], version)
            wait_until(lambda v=version: _version(gateway.base_url) == v, f"policy {version} applied")  # type: ignore[misc]
        chunks.extend(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        body = httpx.get(f"{gateway.base_url}/sessions/{session_id}", headers={"authorization": "Bearer k"}).json()

    (turn,) = body["turns"]
    assert turn["finish_reason"] == "length" and len(turn["output_ids"]) == 3000
    spans = turn["policy_versions"]
    assert [v for v, _ in spans] == [0, 1, 2], f"the stream ended before both updates landed: {spans}"
    assert 0 == spans[0][1] < spans[1][1] < spans[2][1] < 3000

    def check(tokens: list[int], mask: list[int], logprobs: list[float], versions: list[int]) -> None:
        for version, state in states.items():
            own = [m if v == version else 0 for m, v in zip(mask, versions, strict=True)]
            assert any(own)
            assert_chain_logprobs(_model_with(tiny_model_path, state), tokens, own, logprobs, atol=1e-4)

    prompt, output = turn["prompt_ids"], turn["output_ids"]
    ends = [s[1] for s in spans[1:]] + [len(output)]
    versions = [-1] * len(prompt) + [v for (v, start), end in zip(spans, ends, strict=True) for _ in range(end - start)]
    check(prompt + output, [0] * len(prompt) + [1] * len(output), [0.0] * len(prompt) + turn["logprobs"], versions)

    # The same from the events: turn.completed carries the spans, the chain built from it reproduces them.
    events = [e for _, e in read_stream(policy_nats.url)]
    completed = [e for e in events if isinstance(e, TurnCompleted) and e.session_id == session_id]
    assert [list(s) for s in completed[0].policy_versions] == spans
    (trajectory,) = build_trajectories(
        SessionEvents.of(e for e in events if e.session_id == session_id), emitted_because="closed"
    )
    assert (trajectory.min_policy_version, trajectory.max_policy_version) == (0, 2)
    check(trajectory.token_ids, trajectory.loss_mask, trajectory.logprobs, trajectory.token_policy_versions())
    applied = [e for e in events if isinstance(e, PolicyApplied)]
    assert [(e.replica, e.previous_version, e.policy_version) for e in applied] == [
        ("inflight", 0, 1),
        ("inflight", 1, 2),
    ]
    assert all(e.in_flight == 1 and 0 < e.copy_s <= e.pause_s for e in applied)


# -- several gateway processes ----------------------------------------------------------------


@contextmanager
def _gateway_process(model: Path, url: str, replica: str, workdir: Path) -> Iterator[str]:
    """``stream-gateway serve`` in a child process; yields its base URL once /health answers."""
    port = free_port()
    command = [
        sys.executable, "-m", "stream_gateway.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
        "--port", str(port), "--nats-url", url, "--outbox-dir", str(workdir / f"outbox-{replica}"),
    ]  # fmt: skip
    env = {**os.environ, "STREAM_GATEWAY_REPLICA_ID": replica}
    log_path = workdir / f"{replica}.log"
    log = log_path.open("w")  # a file, not a pipe: nobody reads the logs while the test runs
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(process, port, 180, log=log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _corrupt_upload(url: str, good: Path, version: int, mangle: Callable[[bytes], bytes]) -> None:
    """Store a mangled copy of ``good``'s file, announced with the digest of the good one."""
    import hashlib

    from nats.js.api import ObjectMeta, ObjectMetaOptions

    from pipeline.events import PolicyObject, encode_event, new_event_id
    from pipeline.policies import policy_subject

    data = (good / "model.safetensors").read_bytes()

    async def run() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            store = await js.object_store(POLICY_BUCKET)
            name = f"v{version:010d}/model.safetensors"
            meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=64 * 1024))
            await store.put(name, mangle(data), meta=meta)
            event = PolicyUpdated.model_validate(
                {
                    "event_id": new_event_id(), "time": time.time(), "tenant": "_", "session_id": None, "seq": 0,
                    "model": "", "policy_version": version, "bucket": POLICY_BUCKET,
                    "objects": [PolicyObject(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data))],
                }
            )  # fmt: skip
            await js.publish(policy_subject(), encode_event(event), headers={"Nats-Msg-Id": f"policy-{version}"})
        finally:
            await nc.close()

    anyio.run(run)


def test_replicas_converge_late_ones_catch_up_and_bad_policies_are_refused(
    policy_nats: EmbeddedNatsServer, tiny_model_path: Path, tmp_path: Path
) -> None:
    url = policy_nats.url
    base_state = _state(tiny_model_path, None)
    # This module's first test may have published versions already: continue above them.
    start = max([e.policy_version for _, e in read_stream(url) if isinstance(e, PolicyUpdated)], default=0)
    v_full, v_partial = start + 1, start + 3
    full = _save(_state(tiny_model_path, 11), tmp_path / "full")
    name = next(k for k in base_state if k.endswith("norm.weight"))
    partial = _save({name: base_state[name] * 2.0}, tmp_path / "partial")

    with (
        _gateway_process(tiny_model_path, url, "g1", tmp_path) as g1,
        _gateway_process(tiny_model_path, url, "g2", tmp_path) as g2,
    ):
        assert _version(g1) == _version(g2) == start  # both caught up with what was there
        _publish(url, full, v_full)
        wait_until(lambda: _version(g1) == _version(g2) == v_full, "both replicas on the full version")
        _publish(url, partial, v_partial, full=False)
        wait_until(lambda: _version(g1) == _version(g2) == v_partial, "both replicas on the partial version")

        with _gateway_process(tiny_model_path, url, "g3", tmp_path) as g3:
            # Ready means caught up: the newest full version, then the partial one after it.
            assert _version(g3) == v_partial
            replicas = (g1, g2, g3)

            # A byte flipped in storage, a truncated upload, a mis-shaped tensor, an unknown one, a lower version.
            _corrupt_upload(url, full, start + 4, lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]))
            _corrupt_upload(url, full, start + 5, lambda b: b[: len(b) // 2])
            _publish(url, _save({name: torch.ones(3, 5)}, tmp_path / "shape"), start + 6, full=False)
            _publish(url, _save({"model.no_such.weight": torch.ones(2)}, tmp_path / "unknown"), start + 7, full=False)
            _publish(url, full, start + 2)
            expected = {
                start + 4: "digest_mismatch",
                start + 5: "digest_mismatch",
                start + 6: "shape_mismatch",
                start + 7: "unknown_tensors",
                start + 2: "not_newer",
            }

            def rejections() -> dict[tuple[str, int], PolicyRejected]:
                events = [e for _, e in read_stream(url) if isinstance(e, PolicyRejected)]
                return {(e.replica, e.rejected_version): e for e in events}

            wait_until(lambda: len(rejections()) >= 3 * len(expected), "every replica to refuse every bad policy")
            for (replica, version), event in rejections().items():
                assert event.reason == expected[version], (replica, event)
                assert event.policy_version == v_partial  # what it keeps serving
            for base in replicas:
                assert _version(base) == v_partial
                reply = OpenAI(base_url=base + "/v1", api_key="k", max_retries=0).chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                assert reply.choices[0].finish_reason in ("stop", "length")
            # The first replica to refuse a version for good marked it in the policy store.
            marks = _refusal_marks(url)
            assert {v: m[0] for v, m in marks.items()} == {v: r for v, r in expected.items() if r != "not_newer"}
            assert all(m[1] in ("g1", "g2", "g3") for m in marks.values())

        # A replica started after all that comes up on what its peers serve: not the newest upload
        # (truncated), not the last full one published (refused as not newer by the others), not the base.
        with _gateway_process(tiny_model_path, url, "g4", tmp_path) as g4:
            assert _version(g4) == v_partial == _version(g1)
            wait_until(
                lambda: (
                    len([e for _, e in read_stream(url) if isinstance(e, PolicyApplied) and e.replica == "g4"]) >= 2
                ),
                "the late replica's policy.applied events",
            )

    applied = [e for _, e in read_stream(url) if isinstance(e, PolicyApplied) and e.replica in ("g1", "g2", "g3", "g4")]
    by_replica: dict[str, list[int]] = {}
    for event in applied:
        by_replica.setdefault(event.replica, []).append(event.policy_version)
    caught_up = [start] if start else []  # g1 and g2 came up on what the first test had published
    assert by_replica == {"g1": [*caught_up, v_full, v_partial], "g2": [*caught_up, v_full, v_partial]} | {
        "g3": [v_full, v_partial],  # the newest full version, then the partial one after it
        "g4": [v_full, v_partial],  # the same, once the marked versions were left out
    }
    late = [e for _, e in read_stream(url) if isinstance(e, PolicyRejected) and e.replica == "g4"]
    assert late == []  # the marked versions were skipped, not downloaded and refused again
    assert all(e.download_s > 0 and e.pause_s > 0 for e in applied)


def _refusal_marks(url: str) -> dict[int, tuple[str, str, str]]:
    """Every policy version marked refused in the policy store, by version."""
    from pipeline.policies import policy_history, refusal_mark

    async def run() -> dict[int, tuple[str, str, str]]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            marks = {}
            for event in await policy_history(js):
                mark = await refusal_mark(js, event)
                if mark is not None:
                    marks[event.policy_version] = mark
            return marks
        finally:
            await nc.close()

    return anyio.run(run)


def test_a_replay_plan_is_what_a_replica_that_saw_everything_took() -> None:
    from stream_gateway.control._policy_sync import replay_plan

    def event(version: int, full: bool, name: str) -> PolicyUpdated:
        return PolicyUpdated.model_construct(event_id=name, policy_version=version, full=full, adapter=None)

    f1, p3, f5, p6, f2 = (
        event(1, True, "f1"),
        event(3, False, "p3"),
        event(5, True, "f5"),
        event(6, False, "p6"),
        event(2, True, "f2"),
    )
    history = [f1, p3, f5, p6, f2]
    assert replay_plan(history, 0, set()) == [f5, p6]
    assert replay_plan(history, 0, {"f5"}) == [f1, p3, p6]  # p6 is tried on top of p3: live replicas did
    assert replay_plan(history, 0, {"f5", "p6"}) == [f1, p3]  # f2 is not above 3: refused as not newer
    assert replay_plan(history, 0, {"f1", "f5", "p6"}) == [p3]  # on the base, as they did
    assert replay_plan(history, 6, set()) == []


def test_publish_weights_cli_refuses_a_directory_without_safetensors(
    policy_nats: EmbeddedNatsServer, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "stream_stack", "publish-weights", "--nats-url", policy_nats.url]
    result = subprocess.run([*command, "--policy-version", "3", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "no *.safetensors files" in result.stderr
    result = subprocess.run([*command, "--policy-version", "3", str(tmp_path / "nope")], capture_output=True, text=True)
    assert result.returncode == 2 and "no directory" in result.stderr


def test_the_bucket_keeps_the_newest_full_versions_and_the_partial_ones_after_them(
    policy_nats: EmbeddedNatsServer, tmp_path: Path
) -> None:
    """``keep_full=2``: a replica catching up needs the newest full version and the partials after it."""
    from pipeline.streams import StreamSpec

    directory = _save({"w": torch.ones(2)}, tmp_path / "w")
    spec = StreamSpec(prefix="prune", stream="PRUNE")  # not the stream this module's gateways follow
    for version, full in ((1, True), (2, False), (3, True), (4, False), (5, True), (6, False)):
        _publish(policy_nats.url, directory, version, spec=spec, bucket="prune_policies", full=full, keep_full=2)

    async def names() -> list[str]:
        nc = await nats.connect(policy_nats.url)
        try:
            store = await nc.jetstream().object_store("prune_policies")
            return sorted(i.name for i in await store.list() if not i.deleted)
        finally:
            await nc.close()

    assert [name.split("/")[0] for name in anyio.run(names)] == [f"v{v:010d}" for v in (3, 4, 5, 6)]
