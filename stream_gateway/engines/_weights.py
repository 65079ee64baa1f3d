"""Reading and checking checkpoints before an engine applies them (nothing here pauses decoding).

Every check happens before the engine's worker stops for the copy, so a bad checkpoint costs the
requests in flight nothing: names the model lacks (``unknown_tensors``), shapes that differ
(``shape_mismatch``), and files that are not whole safetensors (``unreadable``) are refused with
:class:`WeightsRejected`. Dtypes may differ: the copy converts (a bf16 trainer feeding an fp32
engine is normal).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from stream_gateway._errors import WeightsRejected

__all__ = ["check_tensors", "read_checkpoint"]


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in the directory ``path`` (blocking: run off the loop)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise WeightsRejected("unreadable", f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:  # truncated or not safetensors at all
            raise WeightsRejected("unreadable", f"{file.name} is not a readable safetensors file: {exc}") from exc
    return tensors


def check_tensors(targets: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse ``tensors`` unless every name is one of ``targets`` with the same shape."""
    if not tensors:
        raise WeightsRejected("unreadable", "the checkpoint holds no tensors")
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise WeightsRejected("unknown_tensors", f"the model has no tensors named {unknown[:5]}{more}")
    for name, tensor in tensors.items():
        want = tuple(targets[name].shape)
        if tuple(tensor.shape) != want:
            raise WeightsRejected("shape_mismatch", f"{name} has shape {tuple(tensor.shape)}, the model's is {want}")
