"""The batcher against a real nats-server: grouping, policies, artifacts, and exactly once under kill -9.

Trajectories are synthetic (random ids, masks, logprobs) and published the way the assembler
publishes them (:func:`pipeline.durable.publish_durable`, the trajectory id as ``Nats-Msg-Id``);
each test uses streams and buckets of its own on the session's server.
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import pyarrow.parquet as pq
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from consumers.batch_record import BatchRecord
from consumers.batcher import Batcher, BatcherConfig
from consumers.cli import add_commands
from consumers.cli import batcher_config as batcher_config_from_args
from consumers.grouping import GroupingPolicy, GroupPlanner, PlannedBatch
from consumers.parquet import BatchManifest, decode_batch
from consumers.streams import ConsumerStreams, ensure_consumer_streams
from consumers.trajectory import Trajectory
from consumers.verl_batch import group_uid, padded_batch, to_data_proto
from pipeline.connection import NatsAuth
from pipeline.durable import publish_durable
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import PolicyUpdated, encode_event, new_event_id
from pipeline.policies import adapter_subject, policy_subject
from pipeline.streams import StreamSpec, ensure_stream, event_subject

from ..support.trajectories import make_trajectory

# make_trajectory's tenant
TENANT = "tenant1"


def _uids(*labels: str) -> list[str]:
    """The group uids of ``labels``: a label is its tenant's name (``tenant/label``)."""
    return [f"{TENANT}/{label}" for label in labels]


pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


# -- helpers (also used by test_verl_adapter) ------------------------------------------------


def unique_names(**overrides: Any) -> ConsumerStreams:
    """Streams, subjects and buckets no other test uses."""
    tag = secrets.token_hex(4)
    return ConsumerStreams(
        prefix=f"t{tag}",
        events=f"EV_{tag}",
        trajectories=f"TR_{tag}",
        batches=f"BA_{tag}",
        payload_bucket=f"pl_{tag}",
        batch_bucket=f"bb_{tag}",
        state_bucket=f"as_{tag}",
        **overrides,
    )


@asynccontextmanager
async def jetstream(url: str, names: ConsumerStreams) -> AsyncIterator[tuple[Client, JetStreamContext]]:
    """A connection, with the consumer streams provisioned."""
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_consumer_streams(js, names)
        yield nc, js
    finally:
        await nc.close()


async def publish(nc: Client, js: JetStreamContext, names: ConsumerStreams, *trajectories: Trajectory) -> None:
    """As the assembler does."""
    for t in trajectories:
        await publish_durable(
            nc, js, names.trajectory_subject(t), t.trajectory_id, t.encode(), bucket=names.payload_bucket
        )


async def read_manifests(js: JetStreamContext, names: ConsumerStreams) -> list[tuple[str, BatchManifest]]:
    """Every manifest on the batches stream, in order, with its Nats-Msg-Id."""
    info = await js.stream_info(names.batches)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(names.batches, seq)
        out.append(((raw.headers or {}).get("Nats-Msg-Id", ""), BatchManifest.decode(raw.data or b"")))
    return out


async def read_object(js: JetStreamContext, manifest: BatchManifest) -> bytes:
    store = await js.object_store(manifest.bucket)
    return bytes((await store.get(manifest.object)).data or b"")


async def wait_until(predicate: Callable[[], Any]) -> None:
    """Poll ``predicate`` (sync, or returning an awaitable) until true; bound it with ``fail_after``."""
    while True:
        value = predicate()
        if hasattr(value, "__await__"):
            value = await value
        if value:
            return
        await anyio.sleep(0.05)


def batcher_config(url: str, names: ConsumerStreams, **overrides: Any) -> BatcherConfig:
    values: dict[str, Any] = {
        "servers": (url,),
        "names": names,
        "state_bucket": f"st_{names.prefix}",
        "prompt_length": 16,
        "response_length": 32,
        "ack_wait_s": 5.0,
        "policy_poll_s": 0.1,
    }
    return BatcherConfig.of(**(values | overrides))


# -- grouping and artifacts --------------------------------------------------------------------


async def test_whole_groups_make_a_batch_and_incomplete_ones_wait(
    nats_server: EmbeddedNatsServer, tmp_path: Path
) -> None:
    rng = random.Random(1)
    names = unique_names()
    g1 = [make_trajectory(rng, group="g1", version=3) for _ in range(4)]
    g2 = [make_trajectory(rng, group="g2", version=4, min_version=2) for _ in range(4)]
    g3 = [make_trajectory(rng, group="g3") for _ in range(4)]
    g4 = [make_trajectory(rng, group="g4") for _ in range(4)]
    # g3 starts first but stays incomplete; g1 completes before g2.
    order = [g3[0], g1[0], g2[0], g1[1], g3[1], g2[1], g1[2], g2[2], g1[3], g3[2], g2[3]]
    lines: list[str] = []
    config = batcher_config(
        nats_server.url, names, batch_size=8, group_size=4, output_dir=tmp_path / "out", progress_interval_s=0.2
    )
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            batcher = Batcher(config, lines.append)
            await tg.start(batcher.run)
            await publish(nc, js, names, *order)
            await wait_until(lambda: batcher.statistics().received == len(order) and batcher.statistics().batches == 1)
            s = batcher.statistics()
            assert (s.held, s.open_groups, s.batches) == (3, 1, 1)

            [(msg_id, manifest)] = await read_manifests(js, names)
            members = [t.trajectory_id for t in g1 + g2]
            assert msg_id == manifest.batch_id == hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()
            assert manifest.trajectory_ids == members
            assert manifest.groups == _uids("g1", "g2") and manifest.group_size == 4
            assert (manifest.min_policy_version, manifest.max_policy_version) == (2, 4)
            assert (manifest.prompt_length, manifest.response_length) == (16, 32)
            assert manifest.object == f"{manifest.batch_id}.parquet" and manifest.bucket == names.batch_bucket

            # The object, the file and the manifest agree, and the rows are the trajectories.
            data = await read_object(js, manifest)
            assert (len(data), hashlib.sha256(data).hexdigest()) == (manifest.size, manifest.sha256)
            path = tmp_path / "out" / manifest.object
            assert path.read_bytes() == data
            assert [p.name for p in (tmp_path / "out").iterdir()] == [manifest.object]  # no temp file left
            table = pq.read_table(path)
            assert table.num_rows == 8 and table.schema.metadata[b"sg.batch_id"] == manifest.batch_id.encode()
            assert table.column("uid").to_pylist() == _uids(*["g1"] * 4, *["g2"] * 4)
            trajectories, uids = decode_batch(data)
            assert trajectories == g1 + g2 and uids == _uids(*["g1"] * 4, *["g2"] * 4)

            # verl accepts it.
            proto = to_data_proto(
                padded_batch(trajectories, uids, prompt_length=16, response_length=32, pad_token_id=0)
            )
            assert proto.batch["input_ids"].shape == (8, 48) and proto.batch["responses"].shape == (8, 32)
            assert list(proto.non_tensor_batch["uid"]) == uids

            # The record says published; the next batch starts with the group that waited.
            kv = await js.key_value(config.state_bucket)
            record = orjson.loads((await kv.get(f"b.{manifest.batch_id}")).value or b"")
            assert record["state"] == "published" and record["members"] == members
            await publish(nc, js, names, g3[3], *g4)
            await wait_until(lambda: batcher.statistics().batches == 2)
            second = (await read_manifests(js, names))[1][1]
            assert second.trajectory_ids == [t.trajectory_id for t in g3 + g4] and second.groups == _uids("g3", "g4")
            await wait_until(lambda: any("2 batches" in line for line in lines))
            assert batcher.statistics().held == 0
            tg.cancel_scope.cancel()


async def test_groups_by_prompt_without_metadata_and_split_oversized_groups(nats_server: EmbeddedNatsServer) -> None:
    rng = random.Random(2)
    names = unique_names()
    branched = [make_trajectory(rng, group="g5") for _ in range(4)]  # one key, two groups' worth
    prompt = [5, 6, 7, 8]
    by_prompt = [make_trajectory(rng, group=None, prompt=prompt) for _ in range(2)]
    g6 = [make_trajectory(rng, group="g6") for _ in range(2)]
    config = batcher_config(nats_server.url, names, batch_size=4, group_size=2)
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await publish(nc, js, names, *branched, *by_prompt, *g6)
            await wait_until(lambda: batcher.statistics().batches == 2)
            first, second = (m for _, m in await read_manifests(js, names))
            assert first.groups == _uids("g5", "g5.1")
            assert decode_batch(await read_object(js, first))[1] == _uids("g5", "g5", "g5.1", "g5.1")
            prompt_uid = group_uid(by_prompt[0], "prompt")
            assert second.groups == [prompt_uid, *_uids("g6")]
            assert second.trajectory_ids == [t.trajectory_id for t in by_prompt + g6]
            tg.cancel_scope.cancel()


# -- policies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
@pytest.mark.parametrize("no_reward", ["drop", "zero"])
async def test_staleness_length_and_reward_policies(
    nats_server: EmbeddedNatsServer, overlong: str, no_reward: str
) -> None:
    rng = random.Random(3)
    names = unique_names()
    fresh = make_trajectory(rng, version=3, prompt_len=4, response_len=6)
    stale = make_trajectory(rng, version=1, prompt_len=4, response_len=6)
    overlong_one = make_trajectory(rng, version=3, prompt_len=4, response_len=12)
    unrewarded = make_trajectory(rng, version=3, reward=None, prompt_len=4, response_len=6)
    long_prompt = make_trajectory(rng, version=3, prompt_len=10, response_len=4)
    config = batcher_config(
        nats_server.url,
        names,
        batch_size=1,
        group_size=1,
        prompt_length=8,
        response_length=8,
        max_staleness=2,
        overlong=overlong,
        no_reward=no_reward,
    )
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            # The gateway announced policy 5: only the events stream says so (no trajectory is at 5).
            await ensure_stream(
                js, StreamSpec(prefix=names.prefix, stream=names.events, payload_bucket=names.payload_bucket)
            )
            update = PolicyUpdated(
                event_id=new_event_id(),
                time=time.time(),
                tenant="anonymous",
                session_id=None,
                seq=0,
                model="tiny",
                policy_version=5,
                previous_version=4,
            )
            await js.publish(event_subject(names.prefix, update), encode_event(update))
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await wait_until(lambda: batcher.statistics().policy_version == 5)
            await publish(nc, js, names, fresh, stale, overlong_one, unrewarded, long_prompt)

            kept = (
                [fresh]
                + ([overlong_one] if overlong == "truncate" else [])
                + ([unrewarded] if no_reward == "zero" else [])
            )
            await wait_until(lambda: batcher.statistics().received == 5 and batcher.statistics().batches == len(kept))
            s = batcher.statistics()
            assert s.dropped_stale == 1
            assert s.dropped_length == 1 + (overlong == "drop")
            assert s.dropped_no_reward == (no_reward == "drop")
            assert s.truncated == (overlong == "truncate")
            assert s.held == 0
            rows: dict[str, Trajectory] = {}
            for _, manifest in await read_manifests(js, names):
                [row], _ = decode_batch(await read_object(js, manifest))
                rows[row.trajectory_id] = row
            assert set(rows) == {t.trajectory_id for t in kept}
            assert rows[fresh.trajectory_id] == fresh
            if overlong == "truncate":
                cut = rows[overlong_one.trajectory_id]
                assert cut.truncated and len(cut.token_ids) == 4 + 8
                assert cut.token_ids == overlong_one.token_ids[:12] and cut.loss_mask == overlong_one.loss_mask[:12]
                assert cut.logprobs == overlong_one.logprobs[:12]
                assert all(turn.start + turn.length <= 12 for turn in cut.turns)
            if no_reward == "zero":
                assert rows[unrewarded.trajectory_id].reward == 0.0
            tg.cancel_scope.cancel()


async def test_a_group_with_a_dropped_member_or_too_old_is_dropped_whole(nats_server: EmbeddedNatsServer) -> None:
    rng = random.Random(4)
    names = unique_names()
    g1 = [make_trajectory(rng, group="g1", reward=None), make_trajectory(rng, group="g1")]
    lonely = make_trajectory(rng, group="g2")
    g3 = [make_trajectory(rng, group="g3") for _ in range(2)]
    config = batcher_config(nats_server.url, names, batch_size=2, group_size=2, group_timeout_s=0.5)
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await publish(nc, js, names, *g1, lonely, *g3)
            await wait_until(lambda: batcher.statistics().dropped_incomplete_group == 2)
            s = batcher.statistics()
            assert (s.dropped_no_reward, s.batches, s.held, s.open_groups) == (1, 1, 0, 0)
            [(_, manifest)] = await read_manifests(js, names)
            assert manifest.trajectory_ids == [t.trajectory_id for t in g3]
            tg.cancel_scope.cancel()


# -- LoRA adapters ------------------------------------------------------------------------------


def on_adapter(trajectory: Trajectory, adapter: str | None) -> Trajectory:
    """``trajectory`` as sampled by LoRA ``adapter`` (``None``: the base model), its versions that adapter's."""
    return Trajectory.model_validate(trajectory.model_dump() | {"adapter": adapter})


async def test_adapters_never_share_a_group_a_batch_or_a_staleness_reference(
    nats_server: EmbeddedNatsServer, tmp_path: Path
) -> None:
    """The base and two adapters interleaved, all with one group key: one adapter per group and per batch,
    and alpha at version 5 makes nothing of the base's (version 0) or beta's (version 1) stale."""
    rng = random.Random(11)
    names = unique_names()
    by_adapter: dict[str | None, list[Trajectory]] = {
        None: [make_trajectory(rng, group="g", version=0) for _ in range(4)],
        "alpha": [on_adapter(make_trajectory(rng, group="g", version=5), "alpha") for _ in range(4)],
        "beta": [on_adapter(make_trajectory(rng, group="g", version=1), "beta") for _ in range(4)],
    }
    stale = on_adapter(make_trajectory(rng, group="h", version=3), "alpha")  # 3 < 5 - 1: alpha's own lag
    interleaved = [t for row in zip(*by_adapter.values(), strict=True) for t in row]
    config = batcher_config(nats_server.url, names, batch_size=4, group_size=2, max_staleness=1, output_dir=tmp_path)
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await publish(nc, js, names, *interleaved[:6], stale, *interleaved[6:])
            await wait_until(lambda: batcher.statistics().batches == 3)
            s = batcher.statistics()
            assert (s.received, s.dropped_stale, s.held, s.open_groups, s.other_adapter) == (13, 1, 0, 1, 0)
            assert s.policy_version == 0 and s.adapter_versions == {None: 0, "alpha": 5, "beta": 1}

            # One manifest per adapter, in the order their first groups completed, each naming its adapter.
            manifests = [m for _, m in await read_manifests(js, names)]
            assert [m.adapter for m in manifests] == [None, "alpha", "beta"]
            kv = await js.key_value(config.state_bucket)
            for manifest in manifests:
                expected = by_adapter[manifest.adapter]
                assert manifest.trajectory_ids == [t.trajectory_id for t in expected]
                assert manifest.groups == _uids("g", "g.1")
                version = expected[0].max_policy_version
                assert (manifest.min_policy_version, manifest.max_policy_version) == (version, version)
                data = await read_object(js, manifest)
                trajectories, uids = decode_batch(data)
                assert trajectories == expected and uids == _uids("g", "g", "g.1", "g.1")
                assert pq.read_table(tmp_path / manifest.object).column("adapter").to_pylist() == [manifest.adapter] * 4
                proto = to_data_proto(
                    padded_batch(trajectories, uids, prompt_length=16, response_length=32, pad_token_id=0)
                )
                assert list(proto.non_tensor_batch["adapter"]) == [manifest.adapter] * 4
                record = BatchRecord.decode((await kv.get(f"b.{manifest.batch_id}")).value or b"")
                assert record.adapter == manifest.adapter and record.state == "published"
            # The base model's manifest and record are what they were before adapters: no `adapter` key.
            raw = [orjson.loads((await js.get_msg(names.batches, seq)).data or b"") for seq in (1, 2, 3)]
            assert ["adapter" in m for m in raw] == [False, True, True] and raw[1]["adapter"] == "alpha"
            base_record = orjson.loads((await kv.get(f"b.{manifests[0].batch_id}")).value or b"")
            assert "adapter" not in base_record
            tg.cancel_scope.cancel()


async def test_adapter_policy_events_move_only_their_adapters_staleness(nats_server: EmbeddedNatsServer) -> None:
    """policy.updated of the base (version 1), then of alpha (7) and beta (3) on the adapters' one
    subject: each is noted, alpha's although beta's came after it, and each judges its own."""
    rng = random.Random(14)
    names = unique_names()
    config = batcher_config(nats_server.url, names, batch_size=1, max_staleness=1)

    def update(version: int, adapter: str | None) -> PolicyUpdated:
        return PolicyUpdated(
            event_id=new_event_id(),
            time=time.time(),
            tenant="anonymous",
            session_id=None,
            seq=0,
            model="tiny",
            policy_version=version,
            adapter=adapter,
        )

    kept = [
        on_adapter(make_trajectory(rng, version=6), "alpha"),  # 6 >= 7 - 1
        on_adapter(make_trajectory(rng, version=7), "beta"),  # 7 >= 8 - 1
        make_trajectory(rng, version=0),  # 0 >= 1 - 1: alpha's 7 and beta's 8 are not the base's
    ]
    stale = [on_adapter(make_trajectory(rng, version=5), "alpha"), on_adapter(make_trajectory(rng, version=6), "beta")]
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            await ensure_stream(
                js, StreamSpec(prefix=names.prefix, stream=names.events, payload_bucket=names.payload_bucket)
            )
            await js.publish(policy_subject(names.prefix), encode_event(update(1, None)))
            for version, adapter in ((7, "alpha"), (3, "beta")):
                await js.publish(adapter_subject(names.prefix), encode_event(update(version, adapter)))
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await wait_until(lambda: batcher.statistics().adapter_versions == {None: 1, "alpha": 7, "beta": 3})
            await js.publish(adapter_subject(names.prefix), encode_event(update(8, "beta")))  # noted on a later poll
            await wait_until(lambda: batcher.statistics().adapter_versions["beta"] == 8)
            # An older one lowers nothing.
            await js.publish(adapter_subject(names.prefix), encode_event(update(3, "beta")))
            await publish(nc, js, names, *stale, *kept)
            await wait_until(lambda: batcher.statistics().received == 5 and batcher.statistics().batches == 3)
            s = batcher.statistics()
            assert (s.dropped_stale, s.policy_version) == (2, 1)
            assert s.adapter_versions == {None: 1, "alpha": 7, "beta": 8}
            batched = [m.trajectory_ids for _, m in await read_manifests(js, names)]
            assert batched == [[t.trajectory_id] for t in kept]
            tg.cancel_scope.cancel()


async def test_a_batcher_per_adapter_takes_only_its_adapters_trajectories(nats_server: EmbeddedNatsServer) -> None:
    """--adapter alpha, --base, and --adapter base (an adapter named "base" is not the base model):
    each reads its own consumer, batches its own and acknowledges the rest there; beta's are left
    for beta's batcher, which starts later and still gets them all."""
    rng = random.Random(12)
    names = unique_names()
    by_adapter: dict[str | None, list[Trajectory]] = {
        adapter: [on_adapter(make_trajectory(rng, group=None, version=v), adapter) for _ in range(2)]
        for adapter, v in ((None, 0), ("alpha", 5), ("base", 2), ("beta", 3))
    }
    interleaved = [t for row in zip(*by_adapter.values(), strict=True) for t in row]
    configs = {
        "alpha": batcher_config(nats_server.url, names, batch_size=2, only_adapter="alpha"),
        None: batcher_config(nats_server.url, names, batch_size=2, only_base=True),
        "base": batcher_config(nats_server.url, names, batch_size=2, only_adapter="base"),
    }
    consumers = {a: c.consumer_name for a, c in configs.items()}
    assert consumers == {"alpha": "batcher-adapter-alpha", None: "batcher-base", "base": "batcher-adapter-base"}
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            batchers = {adapter: Batcher(config) for adapter, config in configs.items()}
            for batcher in batchers.values():  # one state bucket for all: their members are disjoint
                await tg.start(batcher.run)
            await publish(nc, js, names, *interleaved)
            await wait_until(
                lambda: all(b.statistics().received == 8 and b.statistics().batches == 1 for b in batchers.values())
            )
            manifests = {m.adapter: m for _, m in await read_manifests(js, names)}
            assert set(manifests) == {None, "alpha", "base"}
            for adapter, batcher in batchers.items():
                assert manifests[adapter].trajectory_ids == [t.trajectory_id for t in by_adapter[adapter]]
                s = batcher.statistics()
                assert (s.other_adapter, s.held, s.dropped_stale) == (6, 0, 0)
                assert s.policy_version == by_adapter[adapter][0].max_policy_version
                consumer = await js.consumer_info(names.trajectories, consumers[adapter])
                assert (consumer.num_ack_pending, consumer.num_pending) == (0, 0)

            beta = Batcher(batcher_config(nats_server.url, names, batch_size=2, only_adapter="beta"))
            await tg.start(beta.run)
            await wait_until(lambda: beta.statistics().batches == 1)
            last = (await read_manifests(js, names))[-1][1]
            assert last.adapter == "beta" and last.trajectory_ids == [t.trajectory_id for t in by_adapter["beta"]]
            assert beta.statistics().other_adapter == 6
            tg.cancel_scope.cancel()


def test_staleness_groups_and_batches_are_per_adapter_offline() -> None:
    """The planner, as the batcher drives it (note_trajectory, then admit)."""
    rng = random.Random(13)
    planner = GroupPlanner(GroupingPolicy(batch_size=2, group_size=2, max_staleness=0))

    def admit(trajectory: Trajectory) -> object:
        planner.note_trajectory(trajectory)
        return planner.admit(trajectory).outcome

    alpha = [on_adapter(make_trajectory(rng, group="g", version=5), "alpha") for _ in range(2)]
    base = [make_trajectory(rng, group="g", version=0) for _ in range(2)]
    assert admit(alpha[0]) == alpha[0] and admit(base[0]) == base[0]  # alpha's 5 is not the base's
    assert planner.open_groups == 2 and planner.next_batch() is None  # one key, two adapters: two groups
    assert (planner.current_version, planner.version_of("alpha"), planner.version_of("beta")) == (0, 5, None)
    assert admit(on_adapter(make_trajectory(rng, group="s", version=4), "alpha")) == "stale"
    assert admit(base[1]) == base[1] and admit(alpha[1]) == alpha[1]
    assert planner.next_batch() == PlannedBatch(tuple(t.trajectory_id for t in base), tuple(_uids("g", "g")), None)
    assert planner.next_batch() == PlannedBatch(tuple(t.trajectory_id for t in alpha), tuple(_uids("g", "g")), "alpha")
    # A policy.updated of the base moves the base only; one naming alpha moves alpha only.
    planner.note_policy(1)
    assert admit(make_trajectory(rng, group="x", version=0)) == "stale"
    beta = on_adapter(make_trajectory(rng, group="x", version=0), "beta")
    assert admit(beta) == beta
    planner.note_policy(9, "alpha")
    assert planner.versions() == {None: 1, "alpha": 9, "beta": 0}


def test_the_batch_record_and_the_manifest_name_the_adapter_and_leave_the_base_out() -> None:
    policy = GroupingPolicy(batch_size=2, group_size=2)
    base = BatchRecord.assign(PlannedBatch(("tr1", "tr0"), ("q", "q")), policy, created_at=1.5).committed(7)
    alpha = BatchRecord.assign(PlannedBatch(("tr1", "tr0"), ("q", "q"), "alpha"), policy, created_at=1.5)
    assert "adapter" not in orjson.loads(base.encode()) and BatchRecord.decode(base.encode()).adapter is None
    wire = orjson.loads(alpha.committed(7).encode())
    assert list(wire)[-2:] == ["batches_last_seq", "adapter"] and wire["adapter"] == "alpha"
    assert BatchRecord.decode(alpha.committed(7).encode()) == alpha.committed(7)
    manifest = BatchManifest(
        batch_id="b",
        bucket="sg_batches",
        object="b.parquet",
        size=1,
        sha256="0" * 64,
        group_size=2,
        groups=["q"],
        trajectory_ids=["tr1", "tr0"],
        min_policy_version=0,
        max_policy_version=0,
        prompt_length=16,
        response_length=32,
        created_at=1.5,
    )
    assert "adapter" not in orjson.loads(manifest.encode()) and BatchManifest.decode(manifest.encode()) == manifest
    named = manifest.model_copy(update={"adapter": "alpha"})
    assert orjson.loads(named.encode())["adapter"] == "alpha" and BatchManifest.decode(named.encode()) == named


def test_the_adapter_flags_and_fields() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())

    def config(*flags: str) -> BatcherConfig:
        return batcher_config_from_args(parser.parse_args(["batch", *flags]), ("nats://x:4222",), NatsAuth(), None)

    assert (config().adapters, config().consumer_name) == (None, "batcher")
    assert (config("--adapter", "alpha").only_adapter, config("--adapter", "alpha").consumer_name) == (
        "alpha",
        "batcher-adapter-alpha",
    )
    assert (config("--base").only_base, config("--base").consumer_name) == (True, "batcher-base")
    assert config("--adapter", "base").consumer_name == "batcher-adapter-base"  # an adapter named base
    assert config("--adapter", "a.b").consumer_name.startswith("batcher-adapter-h")  # "." cannot be in a name
    with pytest.raises(SystemExit):  # argparse: not allowed with argument --adapter
        parser.parse_args(["batch", "--adapter", "alpha", "--base"])
    with pytest.raises(ValueError, match="only_adapter and only_base exclude each other"):
        BatcherConfig(only_adapter="alpha", only_base=True)
    with pytest.raises(ValueError, match="only_adapter must name an adapter"):
        BatcherConfig(only_adapter="")
    assert BatcherConfig(durable="b2", only_adapter="alpha").consumer_name == "b2-adapter-alpha"


# -- exactly once --------------------------------------------------------------------------------


async def test_a_batch_assigned_before_a_crash_is_published_as_assigned(nats_server: EmbeddedNatsServer) -> None:
    """A previous process's state, written by hand: each case of the module docstring's argument."""
    from nats.js.api import KeyValueConfig, StorageType

    rng = random.Random(5)
    names = unique_names(duplicate_window_s=1.0)
    ts = [make_trajectory(rng, group=None) for _ in range(8)]
    ids = [t.trajectory_id for t in ts]
    uids = [group_uid(t, "prompt") for t in ts]
    config = batcher_config(nats_server.url, names, batch_size=2, group_size=1, group_key="prompt")

    def record(members: list[int], state: str, last_seq: int = 0) -> bytes:
        batch = [ids[i] for i in members]
        return orjson.dumps(
            {
                "batch_id": hashlib.sha256("\n".join(sorted(batch)).encode()).hexdigest(),
                "state": state,
                "members": batch,
                "uids": [uids[i] for i in members],
                "group_size": 1,
                "prompt_length": 16,
                "response_length": 32,
                "overlong": "truncate",
                "no_reward": "drop",
                "created_at": 123.0,
                "batches_last_seq": last_seq,
            }
        )

    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            kv = await js.create_key_value(
                config=KeyValueConfig(bucket=config.state_bucket, storage=StorageType.FILE, history=1)
            )

            async def assign(members: list[int], state: str, last_seq: int = 0) -> str:
                data = record(members, state, last_seq)
                batch_id = orjson.loads(data)["batch_id"]
                for i in members:
                    await kv.put(f"t.{ids[i]}", batch_id.encode())
                await kv.put(f"b.{batch_id}", data)
                return str(batch_id)

            x = await assign([0, 3], "assigned")  # crashed before publishing
            await assign([4, 5], "published")  # crashed before acknowledging
            z_id = hashlib.sha256("\n".join(sorted([ids[6], ids[7]])).encode()).hexdigest()
            fake = BatchManifest(
                batch_id=z_id,
                bucket=names.batch_bucket,
                object=f"{z_id}.parquet",
                size=0,
                sha256="",
                group_size=1,
                groups=[uids[6], uids[7]],
                trajectory_ids=[ids[6], ids[7]],
                min_policy_version=0,
                max_policy_version=0,
                prompt_length=16,
                response_length=32,
                created_at=123.0,
            )
            await js.publish(names.batch_subject, fake.encode(), headers={"Nats-Msg-Id": z_id})
            await assign([6, 7], "assigned", last_seq=0)  # crashed after the manifest, before marking it
            await kv.put(f"t.{ids[1]}", b"0" * 64)  # an index entry whose record was never written
            await anyio.sleep(1.2)  # past the duplicate window: JetStream alone would take Z's manifest again

            await publish(nc, js, names, *ts)
            await js.publish(names.trajectory_subject(ts[2]), ts[2].encode(), headers={"Nats-Msg-Id": "copy"})
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await wait_until(lambda: batcher.statistics().received == 9 and batcher.statistics().batches == 3)
            s = batcher.statistics()
            assert (s.batches, s.recovered_batches, s.duplicates_skipped) == (3, 2, 3)

            manifests = await read_manifests(js, names)
            assert [msg_id for msg_id, _ in manifests].count(z_id) == 1
            by_id = {m.batch_id: m for _, m in manifests}
            assert set(by_id) == {z_id, x, hashlib.sha256("\n".join(sorted(ids[1:3])).encode()).hexdigest()}
            assert by_id[x].trajectory_ids == [ids[0], ids[3]] and by_id[x].created_at == 123.0
            for batch_id in (x, z_id):
                assert orjson.loads((await kv.get(f"b.{batch_id}")).value or b"")["state"] == "published"
            consumer = await js.consumer_info(names.trajectories, config.durable)
            assert (consumer.num_ack_pending, consumer.num_pending) == (0, 0)
            tg.cancel_scope.cancel()


async def test_kill_9_at_every_step_and_at_random_yields_each_trajectory_exactly_once(
    nats_server: EmbeddedNatsServer, tmp_path: Path
) -> None:
    rng = random.Random(6)
    names = unique_names()
    groups = [[make_trajectory(rng, group=f"g{i:02d}") for _ in range(4)] for i in range(16)]
    # Groups interleave, as concurrent sessions do. First 8 whole groups and half of 4 more; then
    # one whole group, which the first restarted batcher sees before the redeliveries (the first
    # run has an ack_wait longer than a restart takes), so its groups pair up differently than
    # before the crash: only the recorded assignment keeps an announced batch together; then the rest.
    first = _shuffled(rng, [t for g in groups[:8] for t in g] + [t for g in groups[8:12] for t in g[:2]])
    shift = groups[12]
    rest = _shuffled(rng, [t for g in groups[8:12] for t in g[2:]] + [t for g in groups[13:] for t in g])
    everything = first + shift + rest
    spec: dict[str, Any] = {
        "servers": [nats_server.url],
        "names": {k: getattr(names, k) for k in names.__dataclass_fields__},
        "state_bucket": f"st_{names.prefix}",
        "batch_size": 8,
        "group_size": 4,
        "prompt_length": 16,
        "response_length": 32,
        "ack_wait_s": 1.0,
        "step_delay_s": 0.1,
        "output_dir": None,
    }
    log_path = tmp_path / "batcher.log"

    def spawn(**extra: Any) -> subprocess.Popen[str]:
        with log_path.open("a") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "tests.support.batcher_process", json.dumps(spec | extra)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    async def end(process: subprocess.Popen[str], *, kill: bool) -> None:
        if kill:
            process.kill()  # SIGKILL: kill -9
        await anyio.to_thread.run_sync(process.wait)
        assert process.stdout is not None
        process.stdout.close()

    async def wait_ready(process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        line = await anyio.to_thread.run_sync(process.stdout.readline)
        assert line.strip() == "ready", log_path.read_text()[-3000:]

    async def covered() -> set[str]:
        return {tid for _, m in await read_manifests(js, names) for tid in m.trajectory_ids}

    async with jetstream(nats_server.url, names) as (nc, js):
        await publish(nc, js, names, *first)
        runs = 0
        with anyio.fail_after(150):
            # A kill right after each step of the exactly-once argument, the next run recovering...
            for step, then_publish, ack_wait in (
                ("manifest", shift, 4.0),
                ("commit", rest, 1.0),
                ("published", [], 1.0),
            ):
                process = spawn(die_at=step, ack_wait_s=ack_wait)
                runs += 1
                await end(process, kill=False)
                assert process.returncode == -9, log_path.read_text()[-3000:]
                await publish(nc, js, names, *then_publish)
            # ...then kills from outside at random moments...
            for _ in range(2):
                process = spawn()
                runs += 1
                await wait_ready(process)
                await anyio.sleep(rng.uniform(0.5, 2.0))
                await end(process, kill=True)
            # ...then one that finishes.
            process = spawn()
            runs += 1
            try:
                await wait_ready(process)
                await wait_until(lambda: _covers(covered, everything))

                async def all_acked() -> bool:
                    info = await js.consumer_info(names.trajectories, "batcher")
                    return info.num_ack_pending == 0 and info.num_pending == 0

                await wait_until(all_acked)
            finally:
                await end(process, kill=True)

        manifests = await read_manifests(js, names)
        msg_ids = [msg_id for msg_id, _ in manifests]
        assert len(msg_ids) == len(set(msg_ids)) == 8  # no batch announced twice
        seen = [tid for _, m in manifests for tid in m.trajectory_ids]
        assert sorted(seen) == sorted(t.trajectory_id for t in everything)  # each exactly once
        group_of = {t.trajectory_id: f"{t.tenant}/{t.metadata['group']}" for t in everything}
        for _, manifest in manifests:
            members = manifest.trajectory_ids
            for i in range(0, 8, 4):  # whole groups, one after another
                assert {group_of[tid] for tid in members[i : i + 4]} == {manifest.groups[i // 4]}
            trajectories, _ = decode_batch(await read_object(js, manifest))
            assert [t.trajectory_id for t in trajectories] == members
        kv = await js.key_value(spec["state_bucket"])
        for _, manifest in manifests:
            assert orjson.loads((await kv.get(f"b.{manifest.batch_id}")).value or b"")["state"] == "published"
        assert runs == 6
        log_text = log_path.read_text()
        assert "assigned before a restart" in log_text and "announced before a restart" in log_text


def _shuffled(rng: random.Random, items: list[Trajectory]) -> list[Trajectory]:
    rng.shuffle(items)
    return items


async def _covers(covered: Callable[[], Any], everything: list[Trajectory]) -> bool:
    return len(await covered()) == len(everything)


async def test_flush_emits_what_is_held_as_a_smaller_batch(nats_server: EmbeddedNatsServer, tmp_path: Path) -> None:
    """``stream-gateway flush`` (issue 43): 3 whole groups held by a batcher of 8 become a batch of 3
    at once; a group not yet whole stays held, and the answer says so."""
    names = unique_names()
    rng = random.Random(9)
    whole = [make_trajectory(rng, group=f"w{i}") for i in range(3)]
    config = batcher_config(nats_server.url, names, batch_size=8, group_size=1)
    with anyio.fail_after(30):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await publish(nc, js, names, *whole)
            await wait_until(lambda: batcher.statistics().received == len(whole))
            assert batcher.statistics().batches == 0  # 3 of 8: nothing yet
            reply = await nc.request(names.flush_subject, b"", timeout=10)
            assert orjson.loads(reply.data) == {"batches": 1, "held": 0, "open_groups": 0}
            [(_, manifest)] = await read_manifests(js, names)
            assert sorted(manifest.trajectory_ids) == sorted(t.trajectory_id for t in whole)
            again = await nc.request(names.flush_subject, b"", timeout=10)  # nothing left: nothing emitted
            assert orjson.loads(again.data)["batches"] == 0
            tg.cancel_scope.cancel()


def test_flush_without_a_batcher_says_so(nats_server: EmbeddedNatsServer) -> None:
    result = subprocess.run([sys.executable, "-m", "consumers.cli", "flush", "--nats-url", nats_server.url,
                             "--subject-prefix", f"t{secrets.token_hex(4)}", "--timeout", "2"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 1 and "no batcher answered" in result.stderr, result
