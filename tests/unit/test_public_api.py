"""The packages export what we mean them to, and the dependency direction holds."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import consumers
import pipeline

ROOT = Path(__file__).resolve().parents[2]


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


def test_trainer_side_modules_import_without_the_web_stack() -> None:
    """``from stream_gateway.moe import replay_routes`` (docs/moe.md) loads neither the app nor
    FastAPI, transformers or torch: the package's ``__init__`` imports ``create_app`` lazily."""
    heavy = ("fastapi", "torch", "transformers", "stream_gateway.app")
    code = "import sys; from stream_gateway.moe import replay_routes; "
    code += f"print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


def test_grouping_a_trajectory_needs_no_torch() -> None:
    """The batcher's grouping (and the one ``group_uid``) imports without torch: a group id is a
    sha256 of ids or a metadata value, and ``consumers.verl_batch`` only re-exports it (issue 39)."""
    code = "import sys; from consumers.grouping import GroupPlanner, group_uid; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False"
    from consumers import grouping, verl_batch

    assert verl_batch.group_uid is grouping.group_uid


def _imports(package: str) -> set[str]:
    """The top-level names the modules of ``package`` import (sub-packages included, lazy imports too)."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_dependency_direction() -> None:
    """``stream_gateway -> pipeline <- consumers`` (docs/architecture.md); only the CLI composes them all."""
    assert not {"stream_gateway", "consumers"} & _imports("pipeline")
    assert "stream_gateway" not in _imports("consumers")
    gateway_modules = [p for p in (ROOT / "stream_gateway").rglob("*.py") if p.name != "cli.py"]
    for path in gateway_modules:
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
        assert not any(m.startswith("consumers") for m in modules), path
    # The model recipes are development tools outside the wheel: no package of the product imports them.
    for package in ("stream_gateway", "pipeline", "consumers", "stream_stack"):
        assert "model_recipes" not in _imports(package), package


# -- stream_gateway's surface, the underscore rule and the import graph ------------------------------

GATEWAY_PACKAGES = [
    "stream_gateway",
    "stream_gateway.capture",
    "stream_gateway.completion",
    "stream_gateway.control",
    "stream_gateway.engines",
    "stream_gateway.engines.remote",
    "stream_gateway.http",
    "stream_gateway.models",
    "stream_gateway.protocols",
    "stream_gateway.sessions",
]


def test_every_package_init_is_its_whole_public_surface() -> None:
    """Each ``__init__``'s ``__all__`` is sorted, names what exists, and leaves out nothing it binds."""
    import importlib
    import types

    for name in [*GATEWAY_PACKAGES, "pipeline", "consumers"]:
        package = importlib.import_module(name)
        exported = package.__all__
        assert exported == sorted(exported), name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert all(hasattr(package, n) for n in exported), name
        tree = ast.parse(Path(package.__file__).read_text())
        bound = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module not in ("__future__", "typing"):
                bound.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
        public = {
            n for n in bound if not n.startswith("_") and not isinstance(getattr(package, n, None), types.ModuleType)
        }
        assert public <= set(exported), (name, sorted(public - set(exported)))


def _private_owner(module: str) -> str | None:
    """The package a private module belongs to (``a.b._c.d`` -> ``a.b``), ``None`` if it is public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


# Who may import another package's private modules, white-box as the tests are: the model recipes
# extend stream_gateway.models' untrained builders and must stay in step with them (model_recipes/__init__.py).
WHITE_BOX = {"model_recipes": "stream_gateway.models"}
# And one instrument: benchmarks/request_steps.py reads a clock inside the front by wrapping its
# private functions, white-box by purpose as a profiler is (it changes nothing else).
WHITE_BOX_MODULES = {"benchmarks.request_steps": "stream_gateway"}


def test_private_modules_are_imported_only_inside_their_package() -> None:
    """httpx's rule: ``pkg._mod`` is imported only from inside ``pkg`` (tests, white-box, may; and
    the model recipes, of ``stream_gateway.models`` only)."""
    offenders = []
    packages = ("stream_gateway", "pipeline", "consumers", "stream_stack", "model_recipes")
    for top in (*packages, "benchmarks", "examples", "scripts"):
        for path in (ROOT / top).rglob("*.py"):
            if any(part.startswith(".venv") for part in path.parts):
                continue  # a tool's own environment (benchmarks/.venv-litellm), not the project's code
            here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                targets: list[str] = []
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
                for target in targets:
                    if target.split(".")[0] not in packages:
                        continue  # a script's own helpers (benchmarks/_procs.py and the like)
                    owner = _private_owner(target)
                    if owner is not None and owner and WHITE_BOX.get(top) == owner:
                        continue
                    if owner and (inside := WHITE_BOX_MODULES.get(here)) and (owner + ".").startswith(inside + "."):
                        continue
                    if owner is not None and owner and not (here + ".").startswith(owner + "."):
                        offenders.append(f"{here} imports {target}")
    assert not offenders, "\n".join(offenders)


def test_no_package_has_an_import_circle_not_even_for_annotations() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    for package in ("stream_gateway", "pipeline", "consumers", "stream_stack", "model_recipes"):
        assert import_graph.circles(import_graph.import_graph(package)) == [], package
        assert import_graph.circles(import_graph.import_graph(package, type_checking=True)) == [], package


ERRORS_MODULES = {
    "stream_gateway": ("stream_gateway/_errors.py", "StreamGatewayError"),
    "pipeline": ("pipeline/errors.py", "PipelineError"),
    "consumers": ("consumers/errors.py", "ConsumerError"),
}


def _exception_classes(package: str) -> dict[str, tuple[str, list[str]]]:
    """``name -> (file, base names)`` of every class of ``package`` that derives from an exception,
    found from the source (a builtin exception, or another such class of the package)."""
    import builtins

    classes: dict[str, tuple[str, list[str]]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                classes[node.name] = (str(path.relative_to(ROOT)), bases)
    known = {
        n
        for n in dir(builtins)
        if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)
    }
    found: dict[str, tuple[str, list[str]]] = {}
    while True:
        more = {n: c for n, c in classes.items() if n not in found and any(b in known or b in found for b in c[1])}
        if not more:
            return found
        found.update(more)


def test_each_package_declares_its_errors_in_one_module_under_one_root() -> None:
    """Issue 39: one exceptions module per package, a small hierarchy. Private classes that only
    carry control flow inside a module (``_Retry``) are the exception to the rule."""
    for package, (module, root) in ERRORS_MODULES.items():
        errors = {n: c for n, c in _exception_classes(package).items() if not n.startswith("_")}
        elsewhere = sorted(f"{file}: {name}" for name, (file, _) in errors.items() if file != module)
        assert not elsewhere, f"{package}'s errors belong in {module}:\n  " + "\n  ".join(elsewhere)

        unrooted = [name for name in errors if not _derives(name, root, errors)]
        assert not unrooted, f"{package}'s errors that do not derive from {root}: {unrooted}"


def _derives(name: str, root: str, classes: dict[str, tuple[str, list[str]]]) -> bool:
    return name == root or any(b in classes and _derives(b, root, classes) for b in classes[name][1])


# -- size bounds (issue 39) ----------------------------------------------------------------------

MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 500
MAX_FUNCTION_LINES = 120
OVER_THE_BOUND: dict[str, str] = {
    # "path:name": "why it stays longer", for the rare piece that reads better whole.
}


def test_modules_classes_and_functions_stay_within_their_size_bounds() -> None:
    """A module over 800 lines, a class over 500 or a function over 120 does several jobs: split it
    by job (as engines/remote/ and engines/_hf_model.py were), or write down here why not."""
    over = []
    for package in ("stream_gateway", "pipeline", "consumers", "stream_stack", "model_recipes"):
        for path in (ROOT / package).rglob("*.py"):
            source = path.read_text()
            where = str(path.relative_to(ROOT))
            if len(source.splitlines()) > MAX_MODULE_LINES and where not in OVER_THE_BOUND:
                over.append(f"{where}: {len(source.splitlines())} lines (module bound {MAX_MODULE_LINES})")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    bound = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > bound and f"{where}:{node.name}" not in OVER_THE_BOUND:
                        over.append(f"{where}:{node.name}: {length} lines (bound {bound})")
    assert not over, "\n".join(over)
