"""Images for vision tests: generated in code, sent as data URLs, and checked against the model.

:func:`forward_logprobs` is the independent check: the Hugging Face model itself, run over a
turn's recorded ids with its images processed again from their bytes, never the gateway's own
account of what it computed.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from pipeline.vision import ImageLimits, VisionProcessor


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    """``image`` as file bytes in ``fmt``."""
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    """A ``data:`` URL of ``data``."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def solid(colour: tuple[int, int, int], size: tuple[int, int] = (96, 64), fmt: str = "PNG") -> bytes:
    """A one-colour image's bytes."""
    return encode(Image.new("RGB", size, colour), fmt)


def noise(size: tuple[int, int], seed: int = 0, fmt: str = "PNG") -> bytes:
    """Random pixels (they do not compress: a large file for a given size)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), fmt)


def image_part(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    """A chat ``image_url`` part."""
    return {"type": "image_url", "image_url": {"url": data_url(data, media_type)}}


def forward_logprobs(
    model: Any, processor: VisionProcessor, ids: Sequence[int], images: Sequence[bytes], start: int
) -> list[float]:
    """Log-probabilities of ``ids[start:]`` under ``model`` over ``ids`` with ``images`` (raw bytes,
    in placeholder order) processed again: a plain forward pass, no cache, no gateway code."""
    processed = [processor.process(data, ImageLimits()) for data in images]
    input_ids = torch.tensor([list(ids)])
    kwargs: dict[str, Any] = {}
    if processed:
        grid = torch.tensor([p.grid_thw for p in processed])
        kwargs["pixel_values"] = torch.from_numpy(np.concatenate([p.pixel_values for p in processed]))
        kwargs["image_grid_thw"] = grid
        kinds = (input_ids == processor.token_id).int()
        kwargs["position_ids"], _ = model.model.get_rope_index(input_ids, mm_token_type_ids=kinds, image_grid_thw=grid)
    with torch.inference_mode():
        logits = model(input_ids=input_ids, **kwargs).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids))]
