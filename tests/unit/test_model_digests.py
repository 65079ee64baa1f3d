"""Built-in models: the same bytes on every machine, and what each directory's marker says it is.

A model a test depends on must be the model the tests were written against: the fresh clone whose
tiny-reasoning answered OpenClaw with a mangled path had trained a different model. So nothing
trains at run time any more. The models that train nothing (``tiny``, ``tiny-moe``, ``smollm2``:
seeded initialisation or a fixed conversion) are the reference bytes (``REFERENCE_WEIGHTS``) on
every machine; the trained ones are their untrained starting point's directory with the weights
file the package ships, which must be the bytes ``SHIPPED_WEIGHTS`` records. A missing or altered
file is a broken installation and says so. What the trained models learned is their own tests'
business (marker ``trained``); that a recipe still trains the same on one machine is checked here
on a short run.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from model_recipes._agent_training import _agent_examples, _fine_tune, _Recipe
from stream_gateway.models import (
    AGENT_VARIANTS,
    MARKER_FILE,
    REASONING_VARIANTS,
    REFERENCE_WEIGHTS,
    SHIPPED_WEIGHTS,
    STARTING_POINTS,
    ShippedWeightsMissing,
    _shipped,
    build_tiny_agent_model,
    recorded_weights_digest,
    resolve_model,
    weights_digest,
)

# The built-in models that train nothing: the same bytes on every machine (seen on AVX2 and AVX-512 ones).
_UNTRAINED = ["tiny", "tiny-moe", "smollm2"]
_TRAINED = [*AGENT_VARIANTS, *REASONING_VARIANTS, "tiny-vl"]
_WEIGHTS_DIR = Path(_shipped.__file__).parent / "weights"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache of this module's own: the trained models are assembled here from nothing but the package."""
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("spec", _UNTRAINED)
def test_a_model_that_trains_nothing_is_the_reference_bytes(spec: str) -> None:
    path = Path(resolve_model(spec))
    digest = weights_digest(path)
    assert recorded_weights_digest(path) == digest, f"{path}'s weights are not the ones its build recorded"
    assert REFERENCE_WEIGHTS[path.name] == digest, (
        f"{spec} ({path}) came out unlike the reference build, and it trains nothing: its recipe is not "
        "deterministic here"
    )


def test_every_trained_model_ships_its_weights_and_nothing_else_ships() -> None:
    assert sorted(SHIPPED_WEIGHTS) == sorted(STARTING_POINTS) == sorted(_TRAINED)
    assert sorted(p.name for p in _WEIGHTS_DIR.iterdir()) == sorted(f"{name}.safetensors" for name in _TRAINED)
    for name, digest in SHIPPED_WEIGHTS.items():
        assert _sha256(_WEIGHTS_DIR / f"{name}.safetensors") == digest, f"{name}'s file is not the recorded one"


@pytest.mark.parametrize("name", _TRAINED)
def test_a_trained_model_is_its_starting_point_with_its_shipped_weights(name: str, cache: Path) -> None:
    path = Path(resolve_model(name, cache))
    start = Path(resolve_model(STARTING_POINTS[name], cache))
    assert path.name == f"{name}-{SHIPPED_WEIGHTS[name][:12]}"
    assert recorded_weights_digest(path) == weights_digest(path) == SHIPPED_WEIGHTS[name]
    files = {p.name for p in path.iterdir()} - {MARKER_FILE}
    assert files == {p.name for p in start.iterdir()} - {MARKER_FILE}
    for file in sorted(files - {"model.safetensors"}):
        assert (path / file).read_bytes() == (start / file).read_bytes(), file
    assert _sha256(path / "model.safetensors") != _sha256(start / "model.safetensors")


def test_a_missing_or_altered_weights_file_is_a_broken_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = tmp_path / "weights"
    shipped.mkdir()
    monkeypatch.setattr(_shipped, "_WEIGHTS_DIR", shipped)
    with pytest.raises(ShippedWeightsMissing, match=r"'tiny-agent' has no shipped weights file .* broken"):
        build_tiny_agent_model(tmp_path / "cache")
    (shipped / "tiny-agent.safetensors").write_bytes(b"not the weights")
    with pytest.raises(ShippedWeightsMissing, match=r"is not the file this version of stream-gateway ships"):
        build_tiny_agent_model(tmp_path / "cache")
    assert issubclass(ShippedWeightsMissing, RuntimeError)
    # Nothing half-made is left to be taken for the model.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-qwen2-v3"]


def test_a_fine_tune_gives_the_same_bytes_twice(tiny_model_path: Path) -> None:
    """The recipes are deterministic on one machine: a short run of tiny-agent's, twice."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    runs = []
    for _ in range(2):
        model = Qwen2ForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        _fine_tune(model, tokenizer, _Recipe("determinism", partial(_agent_examples, reader="read"), 6))
        runs.append({name: tensor.clone() for name, tensor in model.state_dict().items()})
    first, second = runs
    assert first.keys() == second.keys()
    changed = [name for name in first if not torch.equal(first[name], second[name])]
    assert not changed, f"the same recipe trained twice differs in {changed[:5]}"
    untouched = Qwen2ForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    assert any(not torch.equal(first[name], untouched[name]) for name in first), "the fine-tune changed nothing"
