"""Each trained built-in model's recipe: what it starts from, how it trains, and the file it becomes.

A recipe trains its model from its parent (``tiny`` for the tiny-agent variants, the tiny-agent
variant calling the same tool for the tiny-reasoning ones, tiny-agent for tiny-vl; the parents that
are trained models come from their shipped weights, as a user gets them) into a whole model
directory. What ships is only that directory's weights: the gateway puts them in the model's
untrained starting point's directory (``stream_gateway.models.STARTING_POINTS``), so
:func:`train_weights` checks that every other file the recipe wrote is that starting point's, byte
for byte, before it writes the weights file.
"""

from __future__ import annotations

import filecmp
import hashlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from model_recipes._agent_training import build_tiny_agent
from model_recipes._reasoning import build_tiny_reasoning
from model_recipes._vl import build_tiny_vl
from stream_gateway.models import AGENT_VARIANTS, MARKER_FILE, REASONING_VARIANTS, STARTING_POINTS, resolve_model

__all__ = ["RECIPES", "SHIPPED_WEIGHTS_DIR", "Recipe", "build_model", "sha256", "train_weights"]

_log = logging.getLogger("model_recipes")

# Where the package's weights files live in a checkout (the default ``--out``).
SHIPPED_WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "stream_gateway" / "models" / "weights"
_WEIGHTS = "model.safetensors"


@dataclass(frozen=True, slots=True)
class Recipe:
    """How a trained model is made: ``train(parent_dir, target_dir)`` from the model named ``parent``."""

    parent: str
    train: Callable[[Path, Path], None]


def _agent_for(reader: str) -> str:
    return next(name for name, tool in AGENT_VARIANTS.items() if tool == reader)


RECIPES: dict[str, Recipe] = {
    **{name: Recipe("tiny", partial(build_tiny_agent, reader=reader)) for name, reader in AGENT_VARIANTS.items()},
    **{
        name: Recipe(_agent_for(reader), partial(build_tiny_reasoning, reader=reader))
        for name, reader in REASONING_VARIANTS.items()
    },
    "tiny-vl": Recipe("tiny-agent", build_tiny_vl),
}


def build_model(name: str, target: Path, cache_dir: Path) -> Path:
    """Train ``name`` by its recipe into the empty directory ``target``; its parent and starting
    point are built (or assembled) in ``cache_dir``. Returns the starting point's directory."""
    recipe = RECIPES[name]
    parent = Path(resolve_model(recipe.parent, cache_dir))
    start = Path(resolve_model(STARTING_POINTS[name], cache_dir))
    _log.info("%s: training from %s (%s)", name, recipe.parent, parent)
    recipe.train(parent, target)
    return start


def train_weights(name: str, out: Path, cache_dir: Path | None = None) -> Path:
    """Train ``name`` by its recipe and write its weights to ``out/NAME.safetensors`` (replaced whole).

    Raises ``RuntimeError`` if the recipe's directory differs from its starting point's in anything
    but the weights: the gateway would then serve the weights with other files than they were
    trained with. ``cache_dir``: where the parent and the starting point are built (a temporary
    directory, removed after, when ``None``).
    """
    with tempfile.TemporaryDirectory(prefix=f"model-recipes-{name}-") as scratch:
        built = Path(scratch) / name
        built.mkdir()
        start = build_model(name, built, cache_dir if cache_dir is not None else Path(scratch) / "cache")
        _check_starting_point(built, start)
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"{name}.safetensors"
        partial_file = out / f".{name}.safetensors.tmp"
        partial_file.write_bytes((built / _WEIGHTS).read_bytes())
        partial_file.replace(target)
    return target


def _check_starting_point(built: Path, start: Path) -> None:
    """Every file of ``built`` but its weights is ``start``'s, and ``built`` has no file ``start`` lacks."""
    ours = {p.name for p in built.iterdir() if p.is_file()} - {_WEIGHTS}
    theirs = {p.name for p in start.iterdir() if p.is_file()} - {_WEIGHTS, MARKER_FILE}
    differ = sorted(ours ^ theirs) + sorted(n for n in ours & theirs if not filecmp.cmp(built / n, start / n, False))
    if differ:
        raise RuntimeError(
            f"the recipe's model differs from its starting point {start} in {differ}: the shipped weights would "
            "be served with other files than they were trained with (make the untrained builder write what the "
            "recipe writes)"
        )
    _log.info("checked: every file but the weights is %s's", start.name)


def sha256(path: Path) -> str:
    """The sha256 of a file, as ``SHIPPED_WEIGHTS`` records it."""
    return hashlib.sha256(path.read_bytes()).hexdigest()
