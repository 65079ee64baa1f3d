"""The vision part of a verl batch: ``multi_modal_inputs`` and multimodal rotary positions.

What verl 0.9.1's agent loop builds for a Qwen2-VL-style model (mRoPE), read in its code
(``verl/experimental/agent_loop/agent_loop.py`` unless said otherwise), from the images
:mod:`consumers.images` resolved and checked:

* :func:`multi_modal_inputs`: ``AgentLoopWorker._compute_multi_modal_inputs`` (868-918) keeps
  the processor's outputs but ``input_ids`` and ``attention_mask``, as tensors, and adds
  ``images_seqlens`` (916: ``repeat_interleave(grid_h * grid_w, grid_t)``): per row
  ``{"pixel_values": float32 [patches, dim], "image_grid_thw": int64 [images, 3],
  "images_seqlens": int64 [images * t]}``, the row's images in prompt order. A row without
  images is ``{}``: a text-only call of a Qwen2-VL processor returns ``input_ids``,
  ``attention_mask`` and ``mm_token_type_ids``, removed there and in ``_compute_position_ids``
  (937-945). verl's trainer concatenates the rows' dicts key by key
  (``verl/utils/model.py`` ``extract_multi_modal_inputs``, 759-809: empty dicts add nothing), so
  a batch may mix rows with and without images.
* :func:`mrope_position_ids`: ``_compute_position_ids`` (920-965): ``[1, 4, L]``, row 0 the text
  positions (``torch.ones``, then ``0..n-1`` on the attention mask: padding is 1), rows 1-3 the
  model's ``get_rope_index(input_ids, attention_mask, image_grid_thw, mm_token_type_ids)`` with
  type 1 on the image placeholder ids (its zeros on padding). verl binds that function to its
  processor from the model class, with ``processor.config`` the model's config
  (``verl/utils/tokenizer/tokenizer.py`` 205-241: ``Qwen2VLModel.get_rope_index`` and
  ``get_vision_position_ids``). Here the same two transformers functions are bound to a small
  object whose ``config.vision_config.spatial_merge_size`` is the image processor's
  ``merge_size`` (recorded with the traffic; a Qwen2-VL model's config holds the same number),
  so no model config is needed. The tests compare it with the model's own method on random grids.

Deliberate choices:

* Only Qwen2-VL's rotary index is used. Qwen2.5-VL's differs from it for videos only (its time
  steps), and the gateway takes no videos; a model with another index would need its own here.
* A text-only batch is not laid out this way at all (:mod:`consumers.verl_batch` keeps 2-D
  positions): nothing in such a batch says the policy was a vision-language model, and
  Qwen2-VL reads 2-D positions as the same position on all three axes.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .images import ResolvedImage

__all__ = ["mrope_position_ids", "multi_modal_inputs", "rope_index"]


def multi_modal_inputs(images: Sequence[ResolvedImage]) -> dict[str, torch.Tensor]:
    """One row's ``multi_modal_inputs`` (``{}``: a row without images)."""
    if not images:
        return {}
    grid = torch.tensor([image.grid_thw for image in images], dtype=torch.int64)
    pixels = np.concatenate([image.pixel_values for image in images]).astype(np.float32, copy=False)
    return {
        "pixel_values": torch.from_numpy(np.ascontiguousarray(pixels)),
        "image_grid_thw": grid,
        "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]),
    }


def mrope_position_ids(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, images: Sequence[ResolvedImage], merge_size: int
) -> torch.Tensor:
    """One row's ``[1, 4, L]`` positions (``input_ids`` and ``attention_mask`` ``[1, L]``, padded as
    the batch is): text positions, then the model's three rotary axes (see the module docstring).

    ``merge_size`` is the images' spatial merge (any, for a row without images).
    """
    kinds = torch.zeros_like(input_ids)
    grid = None
    if images:
        kinds[input_ids == images[0].token_id] = 1
        grid = torch.tensor([image.grid_thw for image in images], dtype=torch.int64)
    vision, _ = rope_index(merge_size)(
        input_ids=input_ids, mm_token_type_ids=kinds, image_grid_thw=grid, attention_mask=attention_mask
    )
    vision = vision.transpose(0, 1)  # (3, 1, L) => (1, 3, L)
    valid = attention_mask[0].bool()
    text = torch.ones((1, input_ids.shape[1]), dtype=torch.long)
    text[0, valid] = torch.arange(int(valid.sum()))
    return torch.cat((text.unsqueeze(0), vision), dim=1)


@cache
def rope_index(merge_size: int) -> Any:
    """transformers' ``Qwen2VLModel.get_rope_index`` for a spatial merge of ``merge_size``, without a model.

    Bound, as verl binds it to its processor, to an object with just what it reads: the merge
    size in ``config.vision_config`` and ``get_vision_position_ids``.
    """
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    holder = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge_size))
    )
    holder.get_vision_position_ids = types.MethodType(Qwen2VLModel.get_vision_position_ids, holder)
    return types.MethodType(Qwen2VLModel.get_rope_index, holder)
