"""Vision-language verl batches, checked with transformers' and verl 0.9.1's own code.

* The multimodal rotary positions (:func:`consumers.verl_vision.mrope_position_ids`) equal the
  positions the vision model's own ``get_rope_index`` gives, on random grids and paddings.
* Rows with and without images, laid out by :func:`~consumers.verl_batch.padded_batch`, equal what
  verl's agent loop builds from the same rows and the same images
  (``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``, with the processor verl makes);
  the jagged layout equals its v1 per-sample layout and its conversion of the padded batch; verl's
  trainer concatenates the rows' ``multi_modal_inputs`` into the model's inputs.

The model is ``tiny-vl-untrained`` (tiny-vl's tokenizer, template, image processor and architecture,
untrained): layouts and rotary positions do not depend on what the weights learned.
"""

from __future__ import annotations

import asyncio
import io
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from verl.protocol import DataProto
from verl.utils.model import extract_multi_modal_inputs
from verl.workers.utils.padding import left_right_2_no_padding

from consumers.images import ResolvedImage
from consumers.trajectory import Trajectory, TrajectoryImage
from consumers.verl_batch import padded_batch, to_data_proto, to_jagged_tensordict
from consumers.verl_vision import mrope_position_ids
from pipeline.vision import ProcessedImage, VisionProcessor

from ..support.images import png, process, verl_processor, vl_trajectory

RAY_STATE_API_WARNING = "ignore:Ray state API is no longer experimental:DeprecationWarning"
# transformers' processor (create_mm_token_type_ids) calls np.array on the torch tensors verl has it return.
NUMPY_COPY_WARNING = "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
PAD = 2002
RED, BLUE, GREEN = png((230, 20, 20)), png((20, 20, 230), (64, 120)), png((20, 200, 20), (120, 40))


def _resolved(image: TrajectoryImage, processed: ProcessedImage | None = None) -> ResolvedImage:
    pixels = processed.pixel_values if processed is not None else np.zeros((0, 1176), np.float32)
    return ResolvedImage(image, pixels, merge_size=2, token_id=PAD)


def _grid_image(start: int, grid: tuple[int, int, int]) -> TrajectoryImage:
    t, h, w = grid
    return TrajectoryImage(
        sha256="a" * 64,
        media_type="image/png",
        width=14 * w,
        height=14 * h,
        start=start,
        tokens=t * h * w // 4,
        grid_thw=grid,
        pixels_sha256="b" * 64,
        processor="p",
    )


def test_mrope_positions_equal_the_models_own_get_rope_index(vl_path: Path) -> None:
    """Random rows of text and images (grids of 1 or 2 frames, 2 to 16 patches a side), left- and
    right-padded: rows 1-3 are the model's ``get_rope_index`` over the batch, row 0 verl's text positions."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32)
    rng = random.Random(5)
    width = 400
    ids = torch.zeros((24, width), dtype=torch.int64)
    mask = torch.zeros((24, width), dtype=torch.int64)
    rows: list[list[ResolvedImage]] = []
    for i in range(24):
        content: list[int] = []
        images = []
        for _ in range(rng.randrange(0, 4)):
            content += [rng.randrange(10, 1900) for _ in range(rng.randrange(0, 9))] + [2000]
            grid = (rng.choice((1, 2)), 2 * rng.randrange(1, 9), 2 * rng.randrange(1, 9))
            image = _grid_image(len(content), grid)
            images.append(_resolved(image))
            content += [PAD] * image.tokens + [2001]
        content += [rng.randrange(10, 1900) for _ in range(rng.randrange(1, 12))]
        left = rng.randrange(0, width - len(content) + 1)
        ids[i, left : left + len(content)] = torch.tensor(content)
        mask[i, left : left + len(content)] = 1
        rows.append(images)
    assert sum(map(len, rows)) > 20
    grids = torch.tensor([image.grid_thw for images in rows for image in images])
    theirs, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == PAD).int(), image_grid_thw=grids, attention_mask=mask
    )
    for i, images in enumerate(rows):
        ours = mrope_position_ids(ids[i : i + 1], mask[i : i + 1], images, 2)
        assert ours.shape == (1, 4, width) and ours.dtype == torch.int64
        assert torch.equal(ours[0, 1:], theirs[:, i]), i
        valid = mask[i].bool()
        assert torch.equal(ours[0, 0, valid], torch.arange(int(valid.sum())))
        assert (ours[0, 0, ~valid] == 1).all()  # verl's text positions: 1 on padding


def _rows(tokenizer: Any, processor: VisionProcessor) -> tuple[list[Trajectory], list[list[bytes]], list[list[Any]]]:
    """Three rows: two images (one in a second user message), none, one; their bytes; resolved images."""
    red, blue, green = (process(processor, data) for data in (RED, BLUE, GREEN))
    trajectories = [
        vl_trajectory(tokenizer, processor, [red, "Colour?"], "red", follow_up=["And?", blue], second_answer="blue"),
        vl_trajectory(tokenizer, processor, ["No image here."], "hello", reward=-1.0),
        vl_trajectory(tokenizer, processor, ["Look:", green], "green", group="h"),
    ]
    sent = [[RED, BLUE], [], [GREEN]]
    processed = [[red, blue], [], [green]]
    resolved = [
        [_resolved(image, p) for image, p in zip(t.images, row, strict=True)]
        for t, row in zip(trajectories, processed, strict=True)
    ]
    return trajectories, sent, resolved


def _output(trajectory: Trajectory, images: list[bytes]) -> Any:
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    cut = trajectory.prompt_length
    return AgentLoopOutput(
        prompt_ids=trajectory.token_ids[:cut],
        response_ids=trajectory.token_ids[cut:],
        response_mask=trajectory.loss_mask[cut:],
        response_logprobs=trajectory.logprobs[cut:],
        reward_score=trajectory.reward,
        num_turns=2 * trajectory.num_turns,
        metrics=AgentLoopMetrics(),
        multi_modal_data={"images": [Image.open(io.BytesIO(data)) for data in images]} if images else None,
    )


def _worker(vl_path: Path, prompt_length: int, response_length: int) -> Any:
    """verl's agent loop worker without ``__init__`` (a Ray cluster, a rollout server): its
    postprocessing reads only these attributes."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    processor = verl_processor(vl_path)
    worker = object.__new__(AgentLoopWorker)
    worker.tokenizer = processor.tokenizer
    worker.processor = processor
    worker.rollout_config = SimpleNamespace(prompt_length=prompt_length, response_length=response_length)
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    return worker


def _assert_inputs_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key


@pytest.mark.filterwarnings(RAY_STATE_API_WARNING, NUMPY_COPY_WARNING)
def test_the_padded_layout_equals_verls_own_agent_loop_postprocessing(
    vl_path: Path, tokenizer: Any, processor: VisionProcessor
) -> None:
    trajectories, sent, resolved = _rows(tokenizer, processor)
    uids = ["g", "g", "h"]
    p, r = max(t.prompt_length for t in trajectories) + 3, max(t.response_length for t in trajectories) + 3
    worker = _worker(vl_path, p, r)

    async def postprocess() -> DataProto:
        outputs = [
            await worker._agent_loop_postprocess(_output(t, images), validate=False, raw_prompt=[])
            for t, images in zip(trajectories, sent, strict=True)
        ]
        result: DataProto = worker._postprocess(outputs, input_non_tensor_batch={"uid": np.array(uids, dtype=object)})
        return result

    verls = asyncio.run(postprocess())
    pad = tokenizer.pad_token_id
    ours = to_data_proto(
        padded_batch(trajectories, uids, prompt_length=p, response_length=r, pad_token_id=pad, images=resolved)
    )
    ours.check_consistency()
    assert ours.batch["position_ids"].shape == (3, 4, p + r)
    assert set(verls.batch.keys()) == set(ours.batch.keys()) - {"reasoning_mask"}
    for key in sorted(verls.batch.keys()):
        assert verls.batch[key].dtype == ours.batch[key].dtype, key
        assert torch.equal(verls.batch[key], ours.batch[key]), key
    theirs_inputs = verls.non_tensor_batch["multi_modal_inputs"]
    our_inputs = ours.non_tensor_batch["multi_modal_inputs"]
    assert our_inputs.dtype == theirs_inputs.dtype == object and len(our_inputs) == 3
    for mine, verl_row in zip(our_inputs, theirs_inputs, strict=True):
        _assert_inputs_equal(mine, verl_row)
    assert our_inputs[1] == {}  # a row without images, in a batch with some
    assert [len(row["image_grid_thw"]) for row in (our_inputs[0], our_inputs[2])] == [2, 1]

    # What verl's trainer makes of it: the model's inputs, concatenated row by row, and images_seqlens.
    merged = extract_multi_modal_inputs(list(our_inputs))
    pixels = torch.cat([our_inputs[0]["pixel_values"], our_inputs[2]["pixel_values"]])
    assert torch.equal(merged["pixel_values"], pixels)
    assert merged["image_grid_thw"].tolist() == [list(i.grid_thw) for t in trajectories for i in t.images]
    placeholders = (ours.batch["input_ids"] == PAD).sum()
    assert int(placeholders) == int((merged["image_grid_thw"].prod(-1) // 4).sum())
    # Batch operations keep each row's dict with its row.
    first, second = ours.chunk(3)[2], ours.select_idxs([2])
    _assert_inputs_equal(first.non_tensor_batch["multi_modal_inputs"][0], our_inputs[2])
    _assert_inputs_equal(second.non_tensor_batch["multi_modal_inputs"][0], our_inputs[2])


@pytest.mark.filterwarnings(RAY_STATE_API_WARNING, NUMPY_COPY_WARNING)
def test_the_jagged_layout_equals_verls_v1_per_sample_layout_and_its_conversion_of_the_padded_batch(
    vl_path: Path, tokenizer: Any, processor: VisionProcessor
) -> None:
    """``AgentLoopWorkerTQ._agent_loop_postprocess`` (verl/trainer/ppo/v1/agent_loop_tq.py 183-202):
    per sample ``_compute_multi_modal_inputs`` and ``_compute_position_ids`` of the unpadded row
    (``[4, len]``), stacked by ``list_of_dict_to_tensordict``; and ``left_right_2_no_padding``."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    trajectories, sent, resolved = _rows(tokenizer, processor)
    uids = ["g", "g", "h"]
    worker = _worker(vl_path, 1, 1)
    fields = []
    for t, images in zip(trajectories, sent, strict=True):
        input_ids = torch.tensor(t.token_ids)
        attention_mask = torch.ones_like(input_ids)
        inputs = worker._compute_multi_modal_inputs(_output(t, images), input_ids)
        positions = worker._compute_position_ids(input_ids[None], attention_mask[None], inputs).squeeze(0)
        fields.append({"input_ids": input_ids, "position_ids": positions, "multi_modal_inputs": inputs})
    theirs = list_of_dict_to_tensordict(fields)
    ours = to_jagged_tensordict(trajectories, uids, images=resolved)
    for key in ("input_ids", "position_ids"):
        assert ours[key].is_nested and ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key].offsets(), theirs[key].offsets()) and torch.equal(
            ours[key].values(), theirs[key].values()
        ), key
    assert [row.shape for row in ours["position_ids"].unbind()] == [(4, len(t.token_ids)) for t in trajectories]
    for mine, verl_row in zip(ours["multi_modal_inputs"], theirs["multi_modal_inputs"], strict=True):
        _assert_inputs_equal(mine, verl_row)

    padded = to_data_proto(
        padded_batch(trajectories, uids, prompt_length=64, response_length=32, pad_token_id=0, images=resolved)
    )
    converted = left_right_2_no_padding(padded.to_tensordict())
    assert torch.equal(converted["position_ids"].values(), ours["position_ids"].values())
    assert torch.equal(converted["input_ids"].values(), ours["input_ids"].values())


def test_images_must_be_given_and_be_the_rows_and_text_only_batches_keep_2d_positions(
    tokenizer: Any, processor: VisionProcessor
) -> None:
    trajectories, _, resolved = _rows(tokenizer, processor)
    uids = ["g", "g", "h"]
    shape = {"prompt_length": 64, "response_length": 32, "pad_token_id": 0}
    with pytest.raises(ValueError, match="a row has images but none were given"):
        padded_batch(trajectories, uids, **shape)
    with pytest.raises(ValueError, match="the images given are not its images"):
        padded_batch(trajectories, uids, **shape, images=[resolved[2], [], resolved[0]])
    with pytest.raises(ValueError, match="images for 2 rows, not 3"):
        to_jagged_tensordict(trajectories, uids, images=resolved[:2])
    text = padded_batch(trajectories[1:2], ["g"], **shape, images=[[]])
    assert text.tensors["position_ids"].shape == (1, 96) and list(text.non_tensors["multi_modal_inputs"]) == [{}]
    jagged = to_jagged_tensordict(trajectories[1:2], ["g"])
    assert jagged["position_ids"].unbind()[0].tolist() == list(range(len(trajectories[1].token_ids)))
