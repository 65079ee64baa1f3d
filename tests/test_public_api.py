"""The packages export what we mean them to, and the dependency direction holds."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import consumers
import pipeline

ROOT = Path(__file__).resolve().parent.parent


def test_pipeline_exports() -> None:
    assert pipeline.__all__ == sorted(pipeline.__all__)
    assert {"EventPublisher", "EmbeddedNatsServer", "TurnCompleted", "decode_event", "encode_event"} <= set(
        pipeline.__all__
    )
    assert all(hasattr(pipeline, name) for name in pipeline.__all__)


def test_consumers_exports() -> None:
    assert consumers.__all__ == sorted(consumers.__all__)
    assert {"Trajectory", "AssemblerConfig", "BatcherConfig", "run_assembler", "run_batcher"} <= set(consumers.__all__)
    with warnings.catch_warnings():  # StreamCheckpointManager imports verl, which imports ray's deprecated API
        warnings.simplefilter("ignore", DeprecationWarning)
        assert all(hasattr(consumers, name) for name in consumers.__all__)


def test_importing_consumers_does_not_import_verl() -> None:
    """``StreamCheckpointManager`` is exported lazily: verl and ray take seconds to import."""
    code = "import sys, consumers; print(sorted(m for m in ('ray', 'torch', 'verl') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_dependency_direction() -> None:
    """``stream_gateway -> pipeline <- consumers`` (DESIGN.md); only the CLI composes them all."""
    assert not {"stream_gateway", "consumers"} & _imports("pipeline")
    assert "stream_gateway" not in _imports("consumers")
    gateway_modules = [p for p in (ROOT / "stream_gateway").rglob("*.py") if p.name != "cli.py"]
    for path in gateway_modules:
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
        assert not any(m.startswith("consumers") for m in modules), path
