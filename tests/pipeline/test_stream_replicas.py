"""Replicas on a real three-node JetStream cluster: who sets them, and who leaves them alone.

A gateway (``serve --stream-replicas 3``) owns the events stream's replicas and limits;
``publish-weights``, ``assemble`` and ``batch`` only use it. Without ``--stream-replicas`` they
create what is missing with one replica and change no existing count; with it, they create and
bring their streams and buckets to that many. The commands run in-process through their real
parsers; the consumers' loops are not started (``_run_consumer`` hands back the configuration),
and their provisioning is run as they run it at connect (``ensure_consumer_streams``,
``open_state_bucket``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
import torch
from nats.aio.client import Client
from nats.js import JetStreamContext
from safetensors.torch import save_file

import consumers.cli
import pipeline.cli
from consumers._batch_writer import open_state_bucket
from consumers.streams import ensure_consumer_streams
from pipeline.embedded import EmbeddedNatsCluster
from pipeline.streams import MAX_REPLICAS, StreamSpec, ensure_object_store, ensure_stream

MAX_BYTES = 64 * 2**20  # the gateway's --stream-max-bytes: publish-weights must not lift it either


async def _ignore_error(exc: Exception) -> None:
    """nats-py logs every failed connect attempt; a cluster's servers may still be settling."""


@asynccontextmanager
async def _connected(url: str) -> AsyncIterator[Client]:
    client = await nats.connect(url.split(","), error_cb=_ignore_error, reconnect_time_wait=0.1)
    try:
        yield client
    finally:
        await client.close()


async def _replicas(js: JetStreamContext, *streams: str) -> dict[str, int | None]:
    return {stream: (await js.stream_info(stream)).config.num_replicas for stream in streams}


async def _publish_weights(url: str, directory: Path, version: int, *flags: str) -> None:
    argv = ["publish-weights", str(directory), "--nats-url", url, "--policy-version", str(version), *flags]
    assert await anyio.to_thread.run_sync(pipeline.cli.main, argv) == 0


async def _consumers(url: str, monkeypatch: pytest.MonkeyPatch, js: JetStreamContext, *flags: str) -> None:
    """``assemble`` and ``batch`` with ``flags``, up to their provisioning at connect."""
    configs: dict[str, Any] = {}

    def capture(command: str, run: Any, config: Any) -> int:
        configs[command] = config
        return 0

    monkeypatch.setattr(consumers.cli, "_run_consumer", capture)
    for command in ("assemble", "batch"):
        consumers.cli.main([command, "--nats-url", url, *flags])
        await ensure_consumer_streams(js, configs[command].names)
    await open_state_bucket(js, configs["batch"].state_bucket, configs["batch"].names.replicas)


OWN = ("SG_TRAJECTORIES", "SG_BATCHES", "OBJ_sg_batches", "KV_sg_assembler", "KV_sg_batcher")
"""The consumers' streams and buckets (they share sg_payloads with the gateways)."""


@pytest.mark.anyio
async def test_only_a_given_stream_replicas_changes_a_clusters_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.zeros(4)}, str(weights / "model.safetensors"))
    with anyio.fail_after(120):
        async with EmbeddedNatsCluster(3, store_root=tmp_path / "nats") as cluster, _connected(cluster.url) as nc:
            js = nc.jetstream()
            gateway = StreamSpec(replicas=3, max_bytes=MAX_BYTES)  # as `serve --stream-replicas 3`
            await ensure_stream(js, gateway)
            await ensure_object_store(js, gateway)

            # Issue 30: publish-weights brought SG_EVENTS back to one replica (and no limits).
            await _publish_weights(cluster.url, weights, 1)
            await _consumers(cluster.url, monkeypatch, js)
            events = (await js.stream_info("SG_EVENTS")).config
            assert (events.num_replicas, events.max_bytes) == (3, MAX_BYTES)
            assert await _replicas(js, "OBJ_sg_payloads") == {"OBJ_sg_payloads": 3}
            assert set((await _replicas(js, "OBJ_sg_policies", *OWN)).values()) == {1}  # created with one

            # With the flag, what the consumers own is brought to three, buckets made earlier included...
            await _consumers(cluster.url, monkeypatch, js, "--stream-replicas", "3")
            assert set((await _replicas(js, "SG_EVENTS", "OBJ_sg_payloads", *OWN)).values()) == {3}
            # ... and a consumer started without it leaves them so.
            await _consumers(cluster.url, monkeypatch, js)
            assert set((await _replicas(js, "SG_EVENTS", "OBJ_sg_payloads", *OWN)).values()) == {3}

            await _publish_weights(cluster.url, weights, 2, "--stream-replicas", "3")
            assert await _replicas(js, "SG_EVENTS", "OBJ_sg_policies") == {"SG_EVENTS": 3, "OBJ_sg_policies": 3}
            assert (await js.stream_info("SG_EVENTS")).config.max_bytes == MAX_BYTES


@pytest.mark.parametrize("command", ["assemble", "batch", "publish-weights"])
def test_stream_replicas_is_unset_by_default_and_from_one_to_five(command: str) -> None:
    from stream_gateway import Settings
    from stream_stack.cli import parser

    required = ["DIR", "--policy-version", "1"] if command == "publish-weights" else []
    parse = parser().parse_args
    assert parse([command, *required]).stream_replicas is None
    assert parse([command, *required, "--stream-replicas", "5"]).stream_replicas == 5
    for wrong in ("0", "6", "three"):
        with pytest.raises(SystemExit):
            parse([command, *required, "--stream-replicas", wrong])
    # The gateway's own --stream-replicas takes the same range.
    metadata = Settings.model_fields["stream_replicas"].metadata
    assert [m.ge for m in metadata if hasattr(m, "ge")] == [1]
    assert [m.le for m in metadata if hasattr(m, "le")] == [MAX_REPLICAS] == [5]
    with pytest.raises(ValueError, match="from 1 to 5"):
        StreamSpec(replicas=6)
