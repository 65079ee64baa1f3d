"""Record the part of vLLM's API that ``stream_gateway/engines/vllm.py`` calls, from vLLM's source.

    python scripts/record_vllm_api.py VLLM_SOURCE_DIR [WHEEL] > tests/unit/vllm_api/X.json

VLLM_SOURCE_DIR holds the ``vllm`` package (an unzipped wheel: ``pip download --no-deps vllm==X``,
then ``unzip X.whl '*.py'``); WHEEL, the wheel file, is recorded by name and sha256 as the
provenance (a WHEEL that is no file is recorded as written, e.g. ``NAME.whl#sha256=...``).
Nothing is imported: the source is read with :mod:`ast` (vLLM needs a GPU to import usefully), so
every entry carries the file and line it was read from. tests/unit/test_vllm_calls.py drives the
engine against fakes built from each record; for a new vLLM release, record it beside the others.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

# Classes whose annotated fields are the keyword arguments or attributes the engine uses.
FIELDS = {
    "vllm.engine.arg_utils.EngineArgs": "vllm/engine/arg_utils.py",
    "vllm.engine.arg_utils.AsyncEngineArgs": "vllm/engine/arg_utils.py",
    "vllm.sampling_params.SamplingParams": "vllm/sampling_params.py",
    "vllm.outputs.CompletionOutput": "vllm/outputs.py",
    "vllm.logprobs.Logprob": "vllm/logprobs.py",
    "vllm.config.model.ModelConfig": "vllm/config/model.py",
}
# Classes whose public ``self.x = ...`` attributes, set in ``__init__``, the engine reads.
INIT_ATTRIBUTES = {
    "vllm.v1.engine.async_llm.AsyncLLM": "vllm/v1/engine/async_llm.py",
    "vllm.outputs.RequestOutput": "vllm/outputs.py",
}
# Enums whose members the engine names.
MEMBERS = {"vllm.sampling_params.RequestOutputKind": "vllm/sampling_params.py"}
# ``Literal[...]`` aliases whose values the engine passes.
LITERALS = {
    "vllm.v1.engine.PauseMode": "vllm/v1/engine/__init__.py",
    "vllm.config.model.LogprobsMode": "vllm/config/model.py",
}
# Functions and methods the engine calls (the worker methods through ``collective_rpc``).
SIGNATURES = {
    "vllm.v1.engine.async_llm.AsyncLLM.from_engine_args": "vllm/v1/engine/async_llm.py",
    "vllm.v1.engine.async_llm.AsyncLLM.generate": "vllm/v1/engine/async_llm.py",
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown": "vllm/v1/engine/async_llm.py",
    "vllm.v1.engine.async_llm.AsyncLLM.pause_generation": "vllm/v1/engine/async_llm.py",
    "vllm.v1.engine.async_llm.AsyncLLM.resume_generation": "vllm/v1/engine/async_llm.py",
    "vllm.v1.engine.async_llm.AsyncLLM.reset_prefix_cache": "vllm/v1/engine/async_llm.py",
    "vllm.v1.engine.async_llm.AsyncLLM.collective_rpc": "vllm/v1/engine/async_llm.py",
    "vllm.inputs.engine.tokens_input": "vllm/inputs/engine.py",
    "vllm.v1.worker.gpu_worker.Worker.update_config": "vllm/v1/worker/gpu_worker.py",
    "vllm.v1.worker.gpu_worker.Worker.reload_weights": "vllm/v1/worker/gpu_worker.py",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.reload_weights": "vllm/v1/worker/gpu_model_runner.py",
}
# Names the engine imports, with the module that must define (or re-export) them.
NAMES = {
    "vllm.inputs": ("vllm/inputs/__init__.py", ["tokens_input"]),
    "vllm.exceptions": (
        "vllm/exceptions.py",
        ["GracefulHTTPError", "RetryableRequestError", "VLLMClientError", "VLLMValidationError"],
    ),
    "vllm.v1.engine.exceptions": ("vllm/v1/engine/exceptions.py", ["EngineDeadError", "EngineGenerateError"]),
}


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(name)


def _where(path: str, node: ast.AST) -> str:
    return f"{path}:{getattr(node, 'lineno', 0)}"


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[list[Any]]:
    """[name, kind, has_default] in order, with ``inspect.Parameter`` kind names."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    out: list[list[Any]] = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append([arg.arg, kind, defaults[i]])
    if args.vararg:
        out.append([args.vararg.arg, "VAR_POSITIONAL", False])
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append([arg.arg, "KEYWORD_ONLY", default is not None])
    if args.kwarg:
        out.append([args.kwarg.arg, "VAR_KEYWORD", False])
    return out


def record(root: Path) -> dict[str, Any]:
    trees: dict[str, ast.Module] = {}

    def tree(path: str) -> ast.Module:
        if path not in trees:
            trees[path] = ast.parse((root / path).read_text(), path)
        return trees[path]

    fields: dict[str, dict[str, Any]] = {}
    for qualname, path in FIELDS.items():
        cls = _class(tree(path), qualname.rsplit(".", 1)[1])
        names = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        fields[qualname] = {"at": _where(path, cls), "names": names}
    for qualname, path in INIT_ATTRIBUTES.items():
        cls = _class(tree(path), qualname.rsplit(".", 1)[1])
        init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        assigned = {
            t.attr
            for n in ast.walk(init)
            if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }
        fields[qualname] = {"at": _where(path, init), "names": sorted(a for a in assigned if not a.startswith("_"))}
    members: dict[str, dict[str, Any]] = {}
    for qualname, path in MEMBERS.items():
        cls = _class(tree(path), qualname.rsplit(".", 1)[1])
        names = [t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
        members[qualname] = {"at": _where(path, cls), "names": names}
    literals: dict[str, dict[str, Any]] = {}
    for qualname, path in LITERALS.items():
        name = qualname.rsplit(".", 1)[1]
        node = next(
            n
            for n in tree(path).body
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        )
        values = [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        literals[qualname] = {"at": _where(path, node), "values": values}
    signatures: dict[str, dict[str, Any]] = {}
    for qualname, path in SIGNATURES.items():
        parts = qualname.split(".")
        module = tree(path)
        body: list[ast.stmt] = module.body
        if parts[-2][0].isupper():  # a method
            body = _class(module, parts[-2]).body
        fn = next(n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == parts[-1])
        signatures[qualname] = {"at": _where(path, fn), "params": _params(fn)}
    defined: dict[str, dict[str, str]] = {}
    for module_name, (path, wanted) in NAMES.items():
        found: dict[str, str] = {}
        rows = (root / path).read_text().splitlines()
        for name in wanted:
            # Its definition, else its first mention (a re-export in an __init__).
            line = next((i for i, row in enumerate(rows, 1) if re.match(rf"(class|def) {name}\b", row)), None)
            line = line or next((i for i, row in enumerate(rows, 1) if re.search(rf"\b{name}\b", row)), None)
            if line is not None:
                found[name] = f"{path}:{line}"
        defined[module_name] = found
    version = re.findall(r"^__version__ = .*?['\"](.+?)['\"]", (root / "vllm/_version.py").read_text(), re.M)[0]
    return {
        "vllm": version,
        "fields": fields,
        "members": members,
        "literals": literals,
        "signatures": signatures,
        "names": defined,
    }


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = record(Path(argv[0]))
    if len(argv) == 2:
        wheel = Path(argv[1])
        out["source"] = (
            f"{wheel.name}#sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}" if wheel.is_file() else argv[1]
        )
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
