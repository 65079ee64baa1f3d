"""Images for the consumers' tests: drawn in code, processed by the vision model's own processor, stored as the
gateway does.

The model is ``tiny-vl-untrained`` (tiny-vl's tokenizer, template, image processor and architecture,
untrained): these helpers lay out ids and images, and no test of them depends on what a model learned.
:func:`vl_trajectory` builds a trajectory of a vision-language chat from real token ids (the model's
tokenizer and template markers) and real processed images, with each image's placeholder run
expanded as the gateway expands it; :func:`store_images` puts the bytes and the processor record
into an object store bucket under the gateway's names (``images/<sha256>``,
``processors/<fingerprint>``), as :meth:`stream_gateway.capture.EventRecorder.images_used` does.
"""

from __future__ import annotations

import base64
import io
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from PIL import Image

from consumers.trajectory import Trajectory, TrajectoryImage, TurnSummary, trajectory_id
from pipeline.vision import ImageLimits, ProcessedImage, VisionProcessor

if TYPE_CHECKING:
    from nats.js import JetStreamContext

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def png(colour: tuple[int, int, int], size: tuple[int, int] = (96, 64)) -> bytes:
    """A one-colour PNG's bytes."""
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


def image_part(data: bytes) -> dict[str, Any]:
    """A chat ``image_url`` part with ``data`` as a PNG data URL."""
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(data).decode()}"}}


def vl_processor(model_dir: Path) -> VisionProcessor:
    """The image processor of the Qwen2-VL model in ``model_dir``, as the gateway loads it."""
    config = orjson.loads((model_dir / "config.json").read_bytes())
    return VisionProcessor.from_model(str(model_dir), int(config["image_token_id"]))


def process(processor: VisionProcessor, data: bytes) -> ProcessedImage:
    """``data`` through the processor, as the gateway processes a request's image."""
    return processor.process(data, ImageLimits())


async def store_images(js: JetStreamContext, bucket: str, processor: VisionProcessor, images: Sequence[bytes]) -> None:
    """The processor's record and the images' bytes in ``bucket``, named as the gateway names them."""
    from pipeline.streams import ensure_bucket
    from pipeline.vision import image_digest

    store = await ensure_bucket(js, bucket)
    await store.put(f"processors/{processor.fingerprint}", orjson.dumps(processor.record()))
    for data in images:
        await store.put(f"images/{image_digest(data)}", data)


def image_record(image: ProcessedImage, start: int) -> TrajectoryImage:
    """The trajectory's record of ``image`` placed at ``start``."""
    return TrajectoryImage(
        sha256=image.sha256,
        media_type=image.media_type,
        width=image.width,
        height=image.height,
        start=start,
        tokens=image.tokens,
        grid_thw=image.grid_thw,
        pixels_sha256=image.pixels_sha256,
        processor=image.processor,
    )


def vl_ids(tokenizer: Any, segments: Sequence[str | ProcessedImage], token_id: int) -> tuple[list[int], list[int]]:
    """Token ids of text segments and images (each ``<|vision_start|>``, its run of placeholders,
    ``<|vision_end|>``), and where each image's run starts."""
    ids: list[int] = []
    starts: list[int] = []
    for segment in segments:
        if isinstance(segment, str):
            ids += tokenizer.encode(segment, add_special_tokens=False)
        else:
            ids += tokenizer.convert_tokens_to_ids([VISION_START])
            starts.append(len(ids))
            ids += [token_id] * segment.tokens
            ids += tokenizer.convert_tokens_to_ids([VISION_END])
    return ids, starts


def vl_trajectory(
    tokenizer: Any,
    processor: VisionProcessor,
    prompt: Sequence[str | ProcessedImage],
    answer: str,
    *,
    follow_up: Sequence[str | ProcessedImage] = (),
    second_answer: str = "",
    reward: float = 1.0,
    group: str = "g",
) -> Trajectory:
    """A one- or two-turn trajectory (a second turn when ``follow_up`` is given) with images, whose
    sampled ids are the tokens of the answers and whose logprobs are made up."""
    token_id = processor.token_id
    ids, starts = vl_ids(tokenizer, ["<|im_start|>user\n", *prompt, "<|im_end|>\n<|im_start|>assistant\n"], token_id)
    images = [image for image in prompt if isinstance(image, ProcessedImage)]
    prompt_length = len(ids)
    first = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    turns = [(prompt_length, len(first))]
    ids += first
    if follow_up:
        more, more_starts = vl_ids(
            tokenizer, ["\n<|im_start|>user\n", *follow_up, "<|im_end|>\n<|im_start|>assistant\n"], token_id
        )
        starts += [len(ids) + s for s in more_starts]
        images += [image for image in follow_up if isinstance(image, ProcessedImage)]
        ids += more
        second = tokenizer.encode(second_answer + "<|im_end|>", add_special_tokens=False)
        turns.append((len(ids), len(second)))
        ids += second
    mask = [0] * len(ids)
    for start, length in turns:
        mask[start : start + length] = [1] * length
    turn_ids = [f"turn-{secrets.token_hex(3)}" for _ in turns]
    session = f"s{secrets.token_hex(4)}"
    return Trajectory(
        trajectory_id=trajectory_id(session, turn_ids),
        session_id=session,
        tenant="test",
        model="tiny-vl-untrained",
        metadata={"group": group},
        token_ids=ids,
        loss_mask=mask,
        logprobs=[-0.25 * m for m in mask],
        images=[image_record(image, start) for image, start in zip(images, starts, strict=True)],
        prompt_length=prompt_length,
        turns=[
            TurnSummary(turn_id=t, start=start, length=length, finish_reason="stop", policy_version=0)
            for t, (start, length) in zip(turn_ids, turns, strict=True)
        ],
        num_turns=len(turns),
        min_policy_version=0,
        max_policy_version=0,
        reward=reward,
        reward_source="test",
        emitted_because="closed",
        started_at=1_750_000_000.0,
        ended_at=1_750_000_001.0,
    )


def verl_processor(model_dir: Path) -> Any:
    """The Qwen2-VL processor of ``model_dir`` with the model's rotary index bound to it, as verl's ``hf_processor``
    makes one (``verl/utils/tokenizer/tokenizer.py`` 205-241: ``processor.config``, then
    ``Qwen2VLModel.get_rope_index`` and ``get_vision_position_ids`` bound to the processor).

    Built here rather than by ``hf_processor``: the model directory holds an image processor, not a
    whole ``Qwen2VLProcessor``, and transformers' Qwen2-VL video processor (which that class asks
    for) needs torchvision, which this environment lacks; images never touch it.
    """
    import types

    from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    class ImagesOnly(Qwen2VLProcessor):  # type: ignore[misc]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    processor = ImagesOnly(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
    )
    processor.config = AutoConfig.from_pretrained(model_dir)
    processor.get_rope_index = types.MethodType(Qwen2VLModel.get_rope_index, processor)
    processor.get_vision_position_ids = types.MethodType(Qwen2VLModel.get_vision_position_ids, processor)
    return processor
