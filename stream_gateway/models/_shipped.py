"""The trained built-in models, assembled from the weights files that ship with the package.

A trained model (tiny-agent, tiny-reasoning, tiny-vl and their variants) is its untrained starting
point's directory (``STARTING_POINTS``: ``tiny``, ``tiny-reasoning-untrained``,
``tiny-vl-untrained``, each built here in seconds) with the trained weights from
``weights/NAME.safetensors`` in place of the untrained ones: the tokenizer, template, configs and
image processor are the starting point's, byte for byte, which is what the recipe that trained the
weights built too (``python -m model_recipes`` checks that before it writes a file).

Deliberate choices:

* The weights ship rather than train on first use: training on CPU took minutes a model, and the
  same seeded recipe gave other bytes (and, at the recipes' margins, other answers) on another
  CPU, since torch and MKL pick their float kernels by the CPU. A file is the same bytes everywhere
  at once. The recipes live outside the package (``model_recipes/`` in the repository).
* ``SHIPPED_WEIGHTS`` records each file's sha256, and the assembly checks it: a missing or altered
  file is a broken installation, and says so (:class:`ShippedWeightsMissing`) rather than serving
  other weights under the model's name.
* The cache directory is named by the digest (``tiny-agent-8dd979c791f7``): new weights are a new
  directory, with no version to bump.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from stream_gateway._errors import ShippedWeightsMissing
from stream_gateway.models._cache import MARKER_FILE, _cached_build

__all__ = ["SHIPPED_WEIGHTS", "STARTING_POINTS", "ShippedWeightsMissing"]

# The sha256 of each weights file in weights/ (NAME.safetensors), as `python -m model_recipes NAME`
# printed it when the file was made (all on 2026-12-06, on a 2-core x86 machine with AVX-512;
# tiny-agent and tiny-agent-claude by the same recipes before they moved to model_recipes/).
SHIPPED_WEIGHTS = {
    "tiny-agent": "8dd979c791f70174efc7bd3d4e91a9a5caae7a339328aea83278100025cef433",
    "tiny-agent-claude": "a122d38b8a6f66bb165a3b3dd354acb48cfd161df829e02ca56cd5105ec0718f",
    "tiny-agent-codex": "780b88329acd37895f52e3a64a1536383bfd5e586b677934da111ca108cd691c",
    "tiny-reasoning": "121e4647aaf3a6bf8a1bf392350a90e8508d957555c6a7746bff6e9f866ffc18",
    "tiny-reasoning-claude": "a852e4220c3f87df2ff489f6c1e49ed60a1d0979321f3afabda82ea8ecf79a49",
    "tiny-reasoning-codex": "f62eceb3920a17c806cc0a3807b5bdea8410766bf3af22afe5109853ed536cc4",
    "tiny-vl": "69de7705d5bd8e184c82419a9fd3c58709eab38e0031811fee1be0cc1da0e0b5",
}
# Each trained model's untrained starting point: its directory, with the shipped weights, is the model.
STARTING_POINTS = {
    "tiny-agent": "tiny",
    "tiny-agent-claude": "tiny",
    "tiny-agent-codex": "tiny",
    "tiny-reasoning": "tiny-reasoning-untrained",
    "tiny-reasoning-claude": "tiny-reasoning-untrained",
    "tiny-reasoning-codex": "tiny-reasoning-untrained",
    "tiny-vl": "tiny-vl-untrained",
}
_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
# What the assembly does (the files it copies): a change bumps it, as a builder's version.
_ASSEMBLY_VERSION = 1
_WEIGHTS = "model.safetensors"


def _shipped_model(name: str, starting_point: Path, cache_dir: Path | None) -> Path:
    """The directory of the trained model ``name``: ``starting_point``'s files with its shipped weights."""
    digest = SHIPPED_WEIGHTS.get(name)
    weights = _WEIGHTS_DIR / f"{name}.safetensors"
    if digest is None or not weights.is_file():
        raise ShippedWeightsMissing(
            f"the trained model {name!r} has no shipped weights file ({weights}"
            f"{'' if digest is None else ', recorded in SHIPPED_WEIGHTS'}): this installation of "
            "stream-gateway is broken; reinstall it (from a checkout: `python -m model_recipes "
            f"{name}` trains the file again)"
        )

    def assemble(target: Path) -> None:
        found = hashlib.sha256(weights.read_bytes()).hexdigest()
        if found != digest:
            raise ShippedWeightsMissing(
                f"{weights} is not the file this version of stream-gateway ships (sha256 {found[:16]}, "
                f"recorded {digest[:16]} in SHIPPED_WEIGHTS): this installation is broken, or the file was "
                "remade without recording its digest"
            )
        for path in starting_point.iterdir():
            if path.is_file() and path.name not in (MARKER_FILE, _WEIGHTS):
                shutil.copyfile(path, target / path.name)
        shutil.copyfile(weights, target / _WEIGHTS)

    return _cached_build(cache_dir, f"{name}-{digest[:12]}", _ASSEMBLY_VERSION, assemble, digest)
