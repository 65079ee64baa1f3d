"""Images from events to batches: the trajectory's image fields, the parquet column, the batcher's
cuts, and the image check against a real nats-server with the vision model's own processor
(``tiny-vl-untrained``: tiny-vl's processor and tokenizer, untrained; nothing here asks what it says).

Events are built here (their token ids synthetic, with tiny-vl's placeholder id); the image check
(:class:`consumers.images.ImageStore`) reads objects stored under the gateway's names, and the
tampering cases change what a bucket holds: another image's bytes, a processor configuration
that normalizes or resizes differently, another placeholder id, an object missing.
"""

from __future__ import annotations

import io
import logging
import random
from typing import Any

import anyio
import numpy as np
import orjson
import pydantic
import pytest

from consumers.batcher import Batcher
from consumers.errors import ImagesRefused
from consumers.grouping import prepare_trajectory
from consumers.images import ImageStore
from consumers.parquet import decode_batch, encode_batch
from consumers.trajectories import SessionEvents, build_trajectories
from consumers.trajectory import TRAJECTORY_SCHEMA_VERSION, Trajectory, TrajectoryImage, images_problem
from pipeline.embedded import EmbeddedNatsServer
from pipeline.events import ImageRecord, TurnCompleted
from pipeline.streams import ensure_bucket
from pipeline.vision import VisionProcessor, image_digest

from ..support.events import turn_completed
from ..support.images import png, process, store_images, vl_trajectory
from ..support.trajectories import make_trajectory
from .test_batcher import batcher_config, jetstream, publish, read_manifests, read_object, unique_names, wait_until

PAD = 2002  # <|image_pad|> of tiny-vl and tiny-vl-untrained
START, END = 2000, 2001
RED, BLUE, GREEN = png((230, 20, 20)), png((20, 20, 230), (64, 120)), png((20, 200, 20), (56, 56))


# -- trajectories from events ---------------------------------------------------------------------


def _record(sha: str, start: int, tokens: int) -> ImageRecord:
    return ImageRecord(
        sha256=sha * 64,
        media_type="image/png",
        width=32,
        height=32,
        start=start,
        tokens=tokens,
        grid_thw=(1, 2, 2 * tokens),
        pixels_sha256="e" * 64,
        processor="p1",
    )


A, B = _record("a", 2, 3), _record("b", 11, 2)


def _turn(base: TurnCompleted, **update: Any) -> TurnCompleted:
    return TurnCompleted.model_validate(base.model_dump() | update)


def _image_session(
    *, child_images: list[ImageRecord] | None = None, child_output: list[int] | None = None
) -> list[TurnCompleted]:
    """A user image (A) and an answer, then a second user message with another image (B) and its answer."""
    root = _turn(
        turn_completed(seq=1, turn_id="a", prompt_ids=[1, START, PAD, PAD, PAD, END, 5], output_ids=[7, 8]),
        images=[A],
    )
    child = turn_completed(
        seq=2,
        turn_id="b",
        parent_turn_id="a",
        reused=9,
        prompt_ids=[9, START, PAD, PAD, END, 10],
        output_ids=child_output or [11, 12],
    )
    return [root, _turn(child, images=[A, B] if child_images is None else child_images, started_at=root.started_at + 1)]


def test_a_chains_images_are_its_leafs_placed_in_its_token_ids() -> None:
    refused: list[str] = []
    [trajectory] = build_trajectories(
        SessionEvents.of(_image_session()), emitted_because="closed", on_refused_images=refused.append
    )
    assert not refused and trajectory.schema_version == TRAJECTORY_SCHEMA_VERSION
    assert trajectory.token_ids == [1, START, PAD, PAD, PAD, END, 5, 7, 8, 9, START, PAD, PAD, END, 10, 11, 12]
    assert [TrajectoryImage.model_validate(i.model_dump()) for i in (A, B)] == trajectory.images
    for image in trajectory.images:
        assert trajectory.token_ids[image.start : image.end] == [PAD] * image.tokens
    assert Trajectory.decode(trajectory.encode()) == trajectory

    # A token cap never cuts an image in two: the cut moves before it, and the image goes.
    [cut] = build_trajectories(SessionEvents.of(_image_session()), emitted_because="closed", max_tokens=12)
    assert cut.truncated and cut.token_ids == trajectory.token_ids[:11] and cut.images == trajectory.images[:1]
    [whole] = build_trajectories(SessionEvents.of(_image_session()), emitted_because="closed", max_tokens=13)
    assert whole.token_ids == trajectory.token_ids[:13] and whole.images == trajectory.images


@pytest.mark.parametrize(
    ("session", "reason"),
    [
        ({"child_images": [B]}, "turn a lists 1 images, not those of turn b that lie in its prompt"),
        ({"child_images": [A, _record("b", 11, 3)]}, "images[1]: token ids 11..14 are not 3 placeholder ids"),
        ({"child_output": [PAD, 12]}, f"the placeholder id {PAD} appears 6 times in token_ids for images of 5 tokens"),
    ],
)
def test_a_chain_whose_images_do_not_line_up_is_left_out(
    session: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Logged and reported, never emitted: the vision tower's features would not fill its slots."""
    caplog.set_level(logging.WARNING, logger="consumers.trajectories")
    refused: list[str] = []
    built = build_trajectories(
        SessionEvents.of(_image_session(**session)), emitted_because="closed", on_refused_images=refused.append
    )
    assert built == [] and refused == [reason] and reason in caplog.text


def test_image_fields_are_checked_and_older_trajectories_decode_without() -> None:
    [trajectory] = build_trajectories(SessionEvents.of(_image_session()), emitted_because="closed")
    ids, (first, second) = trajectory.token_ids, trajectory.images
    assert images_problem(ids, [second, first]) is not None  # out of order
    assert "outside the 12 token ids" in str(images_problem(ids[:12], [first, second]))
    touching = [first, second.model_copy(update={"start": first.end})]
    assert "touches the one before" in str(images_problem(ids, touching))
    wire = orjson.loads(trajectory.encode())
    with pytest.raises(pydantic.ValidationError, match="are not 3 placeholder ids"):
        Trajectory.decode(orjson.dumps(wire | {"images": [wire["images"][0] | {"start": 3}]}))
    with pytest.raises(pydantic.ValidationError, match="should match pattern"):
        Trajectory.decode(orjson.dumps(wire | {"images": [wire["images"][0] | {"sha256": "x"}]}))
    # A schema 4 trajectory (written before images) decodes with none.
    plain = build_trajectories(
        SessionEvents.of([turn_completed(seq=1, turn_id="t", prompt_ids=[1, 2], output_ids=[3])]),
        emitted_because="closed",
    )[0]
    old = {k: v for k, v in orjson.loads(plain.encode()).items() if k != "images"} | {"schema_version": 4}
    decoded = Trajectory.decode(orjson.dumps(old))
    assert decoded.schema_version == 4 and decoded.images == []
    assert decoded.model_copy(update={"schema_version": TRAJECTORY_SCHEMA_VERSION}) == plain


def test_images_round_trip_the_parquet_and_old_files_read_without() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    [trajectory] = build_trajectories(SessionEvents.of(_image_session()), emitted_because="closed")
    plain = make_trajectory(random.Random(3), group="g")
    data = encode_batch([trajectory, plain], ["u", "v"], batch_id="b", prompt_length=8, response_length=16)
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.field("images").type.value_type.names == [
        "sha256",
        "media_type",
        "width",
        "height",
        "start",
        "tokens",
        "grid_thw",
        "pixels_sha256",
        "processor",
    ]
    assert [len(row) for row in table.column("images").to_pylist()] == [2, 0]
    assert decode_batch(data) == ([trajectory, plain], ["u", "v"])
    old = table.drop_columns(["images"])
    old = old.set_column(old.schema.get_field_index("schema_version"), "schema_version", pa.array([4, 4], pa.int8()))
    sink = io.BytesIO()
    pq.write_table(old, sink)
    [old_plain] = decode_batch(sink.getvalue())[0][1:]
    assert old_plain.images == []
    assert old_plain.model_copy(update={"schema_version": TRAJECTORY_SCHEMA_VERSION}) == plain


def test_the_batchers_cut_never_splits_an_image() -> None:
    [trajectory] = build_trajectories(SessionEvents.of(_image_session()), emitted_because="closed")
    cut = prepare_trajectory(trajectory, prompt_length=8, response_length=5, overlong="truncate", no_reward="zero")
    assert isinstance(cut, Trajectory) and cut.truncated
    assert cut.token_ids == trajectory.token_ids[:11] and cut.images == trajectory.images[:1]
    kept = prepare_trajectory(trajectory, prompt_length=8, response_length=6, overlong="truncate", no_reward="zero")
    assert isinstance(kept, Trajectory) and kept.token_ids == trajectory.token_ids[:13] and len(kept.images) == 2
    assert len(kept.turns) == 1  # the second turn's sampled ids start at 15
    # A copy whose images were moved off their placeholders (no validation on model_copy) is malformed.
    moved = trajectory.model_copy(update={"images": [trajectory.images[0].model_copy(update={"start": 3})]})
    assert prepare_trajectory(moved, prompt_length=8, response_length=16, overlong="drop", no_reward="zero") == (
        "malformed"
    )


# -- the image check, against a real nats-server ----------------------------------------------------


def _bucket() -> str:
    import secrets

    return f"img_{secrets.token_hex(4)}"


async def _store(js: Any, processor: VisionProcessor, *, record: dict[str, Any] | None = None) -> tuple[str, Any]:
    """A fresh bucket with RED and BLUE stored (and the processor's record, or ``record`` in its place)."""
    bucket = _bucket()
    await store_images(js, bucket, processor, [RED, BLUE])
    store = await ensure_bucket(js, bucket)
    if record is not None:
        await store.put(f"processors/{processor.fingerprint}", orjson.dumps(record))
    return bucket, store


@pytest.mark.anyio
async def test_the_image_store_rebuilds_every_image_exactly_and_caches_it(
    nats_server: EmbeddedNatsServer, processor: VisionProcessor, tokenizer: Any
) -> None:
    red, blue = process(processor, RED), process(processor, BLUE)
    trajectory = vl_trajectory(
        tokenizer, processor, [red, "Colour?"], "red", follow_up=["And this?", blue, red], second_answer="blue"
    )
    assert [i.sha256 for i in trajectory.images] == [red.sha256, blue.sha256, red.sha256]
    names = unique_names()
    with anyio.fail_after(60):
        async with jetstream(nats_server.url, names) as (_, js):
            bucket, _ = await _store(js, processor)
            images = ImageStore(js, bucket)
            resolved = await images.resolve(trajectory)
            assert [r.record for r in resolved] == trajectory.images
            for r, expected in zip(resolved, (red, blue, red), strict=True):
                assert np.array_equal(r.pixel_values, expected.pixel_values) and r.grid_thw == expected.grid_thw
                assert (r.merge_size, r.token_id) == (2, PAD)
            s = images.statistics()
            assert (s.fetched, s.processed, s.cache_hits, s.cached) == (2, 2, 1, 2)
            await images.resolve(trajectory)  # again: all from the cache
            s = images.statistics()
            assert (s.fetched, s.processed, s.cache_hits) == (2, 2, 4)
            small = ImageStore(js, bucket, cache_bytes=red.nbytes + 1)  # room for one: the older goes
            await small.resolve(trajectory)
            assert small.statistics().cached == 1 and small.statistics().cached_bytes <= red.nbytes + 1


async def _refusal(js: Any, bucket: str, trajectory: Trajectory) -> ImagesRefused:
    with pytest.raises(ImagesRefused) as refused:
        await ImageStore(js, bucket).resolve(trajectory)
    return refused.value


@pytest.mark.anyio
async def test_images_that_differ_from_what_the_policy_saw_are_refused(
    nats_server: EmbeddedNatsServer, processor: VisionProcessor, tokenizer: Any
) -> None:
    """Each tampering is caught, with a reason that says which check failed."""
    red = process(processor, RED)
    trajectory = vl_trajectory(tokenizer, processor, [red, "Colour?"], "red")
    record = processor.record()
    names = unique_names()
    with anyio.fail_after(60):
        async with jetstream(nats_server.url, names) as (_, js):
            # Another image's bytes under the image's name.
            bucket, store = await _store(js, processor)
            await store.put(f"images/{red.sha256}", BLUE)
            refusal = await _refusal(js, bucket, trajectory)
            assert not refusal.missing and "have another SHA-256" in refusal.reason

            # A processor that normalizes differently: the same grid, other pixels.
            config = record["config"] | {"image_mean": [0.5, 0.5, 0.5]}
            bucket, _ = await _store(js, processor, record=record | {"config": config})
            refusal = await _refusal(js, bucket, trajectory)
            assert not refusal.missing and "differ from those the policy consumed" in refusal.reason
            assert "another transformers or Pillow" in str(refusal)

            # One that resizes differently: another grid.
            config = record["config"] | {"size": {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}}
            bucket, _ = await _store(js, processor, record=record | {"config": config})
            refusal = await _refusal(js, bucket, trajectory)
            assert "this processor resizes differently" in refusal.reason

            # Another placeholder id than the one in the trajectory's runs.
            bucket, _ = await _store(js, processor, record=record | {"token_id": PAD + 1})
            assert "copies of the processor's placeholder 2003" in (await _refusal(js, bucket, trajectory)).reason

            # A processor this transformers does not have.
            bucket, _ = await _store(js, processor, record=record | {"class": "NoSuchImageProcessor"})
            assert "cannot be rebuilt here" in (await _refusal(js, bucket, trajectory)).reason

            # Missing: an image never stored, a processor never stored, a bucket that does not exist.
            green = vl_trajectory(tokenizer, processor, [process(processor, GREEN)], "green")
            bucket, store = await _store(js, processor)
            refusal = await _refusal(js, bucket, green)
            assert refusal.missing and f"images/{image_digest(GREEN)} is not in bucket {bucket}" in refusal.reason
            await store.delete(f"processors/{processor.fingerprint}")
            refusal = await _refusal(js, bucket, trajectory)
            assert refusal.missing and "the processor object" in refusal.reason
            refusal = await _refusal(js, "no_such_bucket", trajectory)
            assert refusal.missing and refusal.trajectory_id == trajectory.trajectory_id


@pytest.mark.anyio
async def test_the_batchers_check_processes_nothing_and_refuses_what_needs_no_processing(
    nats_server: EmbeddedNatsServer, processor: VisionProcessor, tokenizer: Any
) -> None:
    """Each image is processed once, by the trainer: the batcher's check reads object infos and the
    processor's record only, and still refuses a missing object, another image under the name and
    a placeholder that differs (the pixel check is the trainer's, where the pixels are made)."""
    red, blue = process(processor, RED), process(processor, BLUE)
    trajectory = vl_trajectory(tokenizer, processor, [red, "Colour?"], "red", follow_up=["And this?", blue])
    record = processor.record()
    names = unique_names()
    with anyio.fail_after(60):
        async with jetstream(nats_server.url, names) as (_, js):
            bucket, store = await _store(js, processor)
            images = ImageStore(js, bucket)
            await images.check(trajectory)
            s = images.statistics()
            assert (s.checked, s.fetched, s.processed, s.cached) == (2, 0, 0, 0)

            async def refusal(bucket: str, trajectory: Trajectory) -> ImagesRefused:
                with pytest.raises(ImagesRefused) as refused:
                    await ImageStore(js, bucket).check(trajectory)
                return refused.value

            await store.put(f"images/{red.sha256}", BLUE)
            refused = await refusal(bucket, trajectory)
            assert not refused.missing and "have another SHA-256" in refused.reason
            green = vl_trajectory(tokenizer, processor, [process(processor, GREEN)], "green")
            refused = await refusal(bucket, green)
            assert refused.missing and f"images/{image_digest(GREEN)} is not in bucket" in refused.reason
            bucket, _ = await _store(js, processor, record=record | {"token_id": PAD + 1})
            assert "copies of the processor's placeholder" in (await refusal(bucket, trajectory)).reason


@pytest.mark.anyio
async def test_the_batcher_drops_a_trajectory_whose_images_cannot_be_rebuilt(
    nats_server: EmbeddedNatsServer, processor: VisionProcessor, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Its group goes with it (it can never be whole); a group whose images check out is batched,
    the parquet carrying the references."""
    caplog.set_level(logging.ERROR, logger="consumers.batcher")
    red, blue, green = (process(processor, data) for data in (RED, BLUE, GREEN))

    def row(group: str, image: Any, answer: str) -> Trajectory:
        return vl_trajectory(tokenizer, processor, [image, "Colour?"], answer, group=group)

    good = [row("good", red, "red"), row("good", blue, "blue")]
    bad = [row("bad", red, "red"), row("bad", green, "green")]  # GREEN is never stored
    names = unique_names(image_bucket=_bucket())
    config = batcher_config(nats_server.url, names, batch_size=2, group_size=2, prompt_length=64, response_length=16)
    with anyio.fail_after(60):
        async with jetstream(nats_server.url, names) as (nc, js), anyio.create_task_group() as tg:
            await store_images(js, names.image_bucket, processor, [RED, BLUE])
            batcher = Batcher(config)
            await tg.start(batcher.run)
            await publish(nc, js, names, bad[0], good[0], bad[1], good[1])
            await wait_until(lambda: batcher.statistics().batches == 1 and batcher.statistics().received == 4)
            s = batcher.statistics()
            assert (s.dropped_images, s.dropped_incomplete_group, s.held) == (1, 1, 0)
            assert f"{bad[1].trajectory_id} dropped, its images cannot be trained on" in caplog.text
            assert f"images/{green.sha256} is not in bucket" in caplog.text
            [(_, manifest)] = await read_manifests(js, names)
            trajectories, _ = decode_batch(await read_object(js, manifest))
            assert trajectories == good and [len(t.images) for t in trajectories] == [1, 1]
            tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_trainer_lays_out_checked_images_and_refuses_a_batch_whose_images_fail_there(
    nats_server: EmbeddedNatsServer, processor: VisionProcessor, tokenizer: Any
) -> None:
    """``StreamAgentLoopManager`` rebuilds each batch's images from the bucket: a batch whose images
    check out becomes a DataProto with ``multi_modal_inputs`` and 4-row positions; one whose image
    was changed after batching is refused, naming the row, and stays unacknowledged."""
    from consumers.verl_adapter import StreamAgentLoopManager, StreamSettings

    red, blue, green = (process(processor, data) for data in (RED, BLUE, GREEN))
    first = [vl_trajectory(tokenizer, processor, [red, "?"], "red", follow_up=[blue], group="a") for _ in range(2)]
    second = [vl_trajectory(tokenizer, processor, [green, "?"], "green", group="b") for _ in range(2)]
    names = unique_names(image_bucket=_bucket())
    settings = StreamSettings(
        nats_url=nats_server.url, names=names, prompt_length=64, response_length=32, pad_token_id=0, timeout_s=20
    )
    config = batcher_config(nats_server.url, names, batch_size=2, group_size=2, prompt_length=64, response_length=32)
    with anyio.fail_after(60):
        async with jetstream(nats_server.url, names) as (nc, js):
            await store_images(js, names.image_bucket, processor, [RED, BLUE, GREEN])
            async with anyio.create_task_group() as tg:
                batcher = Batcher(config)
                await tg.start(batcher.run)
                await publish(nc, js, names, *first, *second)
                await wait_until(lambda: batcher.statistics().batches == 2)
                tg.cancel_scope.cancel()
            store = await ensure_bucket(js, names.image_bucket)
            await store.put(f"images/{green.sha256}", BLUE)  # changed after the batcher checked it

            with StreamAgentLoopManager(settings=settings) as manager:
                output = await anyio.to_thread.run_sync(manager.generate_sequences)
                assert list(output.non_tensor_batch["trajectory_id"]) == [t.trajectory_id for t in first]
                assert output.batch["position_ids"].shape == (2, 4, 96)
                inputs = output.non_tensor_batch["multi_modal_inputs"]
                grids = [list(red.grid_thw), list(blue.grid_thw)]
                assert [row["image_grid_thw"].tolist() for row in inputs] == [grids, grids]
                pixels = np.concatenate([red.pixel_values, blue.pixel_values])
                assert np.array_equal(inputs[0]["pixel_values"].numpy(), pixels)
                for _ in range(2):  # refused, and not acknowledged: the same batch comes again
                    with pytest.raises(ImagesRefused, match=f"trajectory {second[0].trajectory_id}: images\\[0\\]"):
                        await anyio.to_thread.run_sync(manager.generate_sequences)
