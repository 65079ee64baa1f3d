"""The ``vllm`` engine's calls checked against vLLM's own API as recorded from its source, on any machine.

tests/unit/vllm_api/<version>.json is the part of vLLM's API the engine uses, as
scripts/record_vllm_api.py read it from that release's wheel, each entry with its file and line:
the fields of ``AsyncEngineArgs``, ``SamplingParams``, ``CompletionOutput`` and ``Logprob``, the
signatures of ``AsyncLLM``'s methods, of ``vllm.inputs.tokens_input`` and of the worker methods
reached through ``collective_rpc``, and the values of ``PauseMode`` and ``LogprobsMode``. Here a
fake ``vllm`` package is built from each record: every fake binds the engine's arguments to the
recorded signature (a keyword that release lacks is a TypeError, as it would be in vLLM) and hands
back objects with only the recorded attributes. The records are the newest release and the oldest
the ``vllm`` extra allows; the real engine on a GPU is tests/gateway/test_engine_vllm.py.
"""

from __future__ import annotations

import enum
import importlib.machinery
import inspect
import json
import re
import sys
import tomllib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from stream_gateway._errors import EngineError, EngineUnavailable, InvalidRequest
from stream_gateway.engines import vllm as vllm_engine
from stream_gateway.engines._base import SamplingParams
from stream_gateway.engines.vllm import VLLMEngine

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


RECORDS = sorted((Path(__file__).parent / "vllm_api").glob("*.json"), key=lambda p: _release(p.stem))


class Surface:
    """One recorded vLLM release: binds calls to its signatures and keeps them in order."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.version: str = record["vllm"]
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.kwargs: dict[str, dict[str, Any]] = {}  # the keyword arguments each fake class was built with
        self.outputs: list[Any] = []
        self.error: BaseException | None = None

    def call(self, qualname: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        entry = self.record["signatures"].get(qualname)
        assert entry is not None, f"the engine calls {qualname}, which is not in the vLLM {self.version} record"
        signature = inspect.Signature(
            [
                inspect.Parameter(
                    name, getattr(inspect.Parameter, kind), default=None if has_default else inspect.Parameter.empty
                )
                for name, kind, has_default in entry["params"]
            ]
        )
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError as exc:
            raise TypeError(f"{qualname} ({entry['at']} in vLLM {self.version}): {exc}") from None
        self.calls.append((qualname.rsplit(".", 1)[1], bound))
        return bound

    def fields(self, qualname: str) -> set[str]:
        return set(self.record["fields"][qualname]["names"])

    def shaped(self, qualname: str, **values: Any) -> SimpleNamespace:
        """An object with only attributes that ``qualname`` has in this release."""
        unknown = set(values) - self.fields(qualname)
        assert not unknown, f"{qualname} has no {sorted(unknown)} in vLLM {self.version}"
        return SimpleNamespace(**values)

    def literal(self, qualname: str) -> list[str]:
        values: list[str] = self.record["literals"][qualname]["values"]
        return values


def _fake_vllm(surface: Surface) -> dict[str, ModuleType]:  # noqa: C901 (one fake per vLLM module)
    """The modules of a fake ``vllm`` package whose every entry point checks against ``surface``."""
    modules = {
        name: ModuleType(name)
        for name in (
            "vllm",
            "vllm.engine",
            "vllm.engine.arg_utils",
            "vllm.exceptions",
            "vllm.inputs",
            "vllm.sampling_params",
            "vllm.v1",
            "vllm.v1.engine",
            "vllm.v1.engine.async_llm",
            "vllm.v1.engine.exceptions",
        )
    }
    root = modules["vllm"]
    root.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # what importlib.util.find_spec returns
    root.__version__ = surface.version  # type: ignore[attr-defined]
    for name, module in modules.items():
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, module)

    class VLLMError(Exception):
        pass

    class VLLMServerError(VLLMError):
        pass

    hierarchy: dict[str, type[Exception]] = {
        "VLLMClientError": type("VLLMClientError", (VLLMError,), {}),
        "GracefulHTTPError": type("GracefulHTTPError", (VLLMError,), {}),
        "RetryableRequestError": type("RetryableRequestError", (VLLMServerError,), {}),
        "EngineDeadError": type("EngineDeadError", (VLLMServerError,), {}),
        "EngineGenerateError": type("EngineGenerateError", (VLLMServerError,), {}),
    }
    hierarchy["VLLMValidationError"] = type("VLLMValidationError", (hierarchy["VLLMClientError"],), {})
    for module_name, names in surface.record["names"].items():
        for name in names:  # only what this release defines: the engine must cope with the rest missing
            if name in hierarchy:
                setattr(modules[module_name], name, hierarchy[name])
            elif name == "tokens_input":

                def tokens_input(*args: Any, **kwargs: Any) -> dict[str, Any]:
                    bound = surface.call("vllm.inputs.engine.tokens_input", *args, **kwargs)
                    return {"type": "token", "prompt_token_ids": bound["prompt_token_ids"]}

                modules[module_name].tokens_input = tokens_input  # type: ignore[attr-defined]

    engine_fields = surface.fields("vllm.engine.arg_utils.EngineArgs") | surface.fields(
        "vllm.engine.arg_utils.AsyncEngineArgs"
    )

    class AsyncEngineArgs:
        def __init__(self, **kwargs: Any) -> None:
            unknown = set(kwargs) - engine_fields
            assert not unknown, f"AsyncEngineArgs has no {sorted(unknown)} in vLLM {surface.version}"
            assert kwargs.get("logprobs_mode", "raw_logprobs") in surface.literal("vllm.config.model.LogprobsMode")
            surface.kwargs["AsyncEngineArgs"] = kwargs

    modules["vllm.engine.arg_utils"].AsyncEngineArgs = AsyncEngineArgs  # type: ignore[attr-defined]

    sampling_fields = surface.fields("vllm.sampling_params.SamplingParams")
    kind = surface.record["members"]["vllm.sampling_params.RequestOutputKind"]["names"]
    make_enum: Any = enum.Enum  # its members come from the record: no type for mypy to check them against
    output_kind = make_enum("RequestOutputKind", kind)

    class VLLMSamplingParams:
        def __init__(self, **kwargs: Any) -> None:
            unknown = set(kwargs) - sampling_fields
            assert not unknown, f"SamplingParams has no {sorted(unknown)} in vLLM {surface.version}"
            surface.kwargs["SamplingParams"] = kwargs
            self.output_kind = kwargs.get("output_kind")

    modules["vllm.sampling_params"].SamplingParams = VLLMSamplingParams  # type: ignore[attr-defined]
    modules["vllm.sampling_params"].RequestOutputKind = output_kind  # type: ignore[attr-defined]

    llm = "vllm.v1.engine.async_llm.AsyncLLM"
    assert "model_config" in surface.fields(llm)

    class AsyncLLM:
        def __init__(self) -> None:
            self.model_config = surface.shaped("vllm.config.model.ModelConfig", max_model_len=64)

        @classmethod
        def from_engine_args(cls, *args: Any, **kwargs: Any) -> AsyncLLM:
            bound = surface.call(f"{llm}.from_engine_args", cls, *args, **kwargs)
            assert isinstance(bound["engine_args"], AsyncEngineArgs)
            return cls()

        def shutdown(self, *args: Any, **kwargs: Any) -> None:
            surface.call(f"{llm}.shutdown", self, *args, **kwargs)

        async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            bound = surface.call(f"{llm}.generate", self, *args, **kwargs)
            assert isinstance(bound["sampling_params"], VLLMSamplingParams)
            assert bound["sampling_params"].output_kind is output_kind.DELTA
            if surface.error is not None:
                raise surface.error
            try:
                for output in surface.outputs:
                    yield output
            except GeneratorExit:  # AsyncLLM.generate aborts the request here
                surface.calls.append(("abort", {"request_id": bound["request_id"]}))
                raise

        async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
            bound = surface.call(f"{llm}.pause_generation", self, *args, **kwargs)
            assert bound.get("mode", "abort") in surface.literal("vllm.v1.engine.PauseMode")

        async def resume_generation(self, *args: Any, **kwargs: Any) -> None:
            surface.call(f"{llm}.resume_generation", self, *args, **kwargs)

        async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
            surface.call(f"{llm}.reset_prefix_cache", self, *args, **kwargs)
            return True

        async def collective_rpc(self, *args: Any, **kwargs: Any) -> list[None]:
            bound = surface.call(f"{llm}.collective_rpc", self, *args, **kwargs)
            method, rpc_args, rpc_kwargs = bound["method"], bound.get("args") or (), bound.get("kwargs") or {}
            worker = f"vllm.v1.worker.gpu_worker.Worker.{method}"
            surface.call(worker, None, *rpc_args, **rpc_kwargs)
            kinds = {kind for _, kind, _ in surface.record["signatures"][worker]["params"]}
            if {"VAR_POSITIONAL", "VAR_KEYWORD"} <= kinds:  # the worker hands them on to its model runner
                surface.call(f"vllm.v1.worker.gpu_model_runner.GPUModelRunner.{method}", None, *rpc_args, **rpc_kwargs)
            return [None]

    modules["vllm.v1.engine.async_llm"].AsyncLLM = AsyncLLM  # type: ignore[attr-defined]
    return modules


def _delta(surface: Surface, steps: list[tuple[int, dict[int, float]]], finish_reason: str | None) -> Any:
    """A ``RequestOutput`` with one DELTA ``CompletionOutput`` shaped as this release has them."""

    def logprob(value: float) -> Any:
        return surface.shaped("vllm.logprobs.Logprob", logprob=value, rank=1)

    completion = surface.shaped(
        "vllm.outputs.CompletionOutput",
        token_ids=[token for token, _ in steps],
        logprobs=[{tid: logprob(lp) for tid, lp in top.items()} for _, top in steps],
        finish_reason=finish_reason,
    )
    return surface.shaped("vllm.outputs.RequestOutput", outputs=[completion], finished=finish_reason is not None)


@pytest.fixture(params=RECORDS, ids=[p.stem for p in RECORDS])
def surface(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Surface]:
    recorded = Surface(json.loads(Path(request.param).read_text()))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, module in _fake_vllm(recorded).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(
        vllm_engine, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: SimpleNamespace())
    )
    yield recorded


@pytest.fixture
async def engine(surface: Surface) -> AsyncIterator[VLLMEngine]:
    async with VLLMEngine("/models/tiny", served_model_name="tiny", max_logprobs=5) as running:
        yield running


async def test_the_engine_is_built_and_stopped_with_what_vllm_takes(surface: Surface) -> None:
    async with VLLMEngine("/models/tiny", engine_kwargs={"dtype": "float32", "enforce_eager": True, "seed": 0}) as e:
        assert e.max_model_len == 64  # read from AsyncLLM.model_config
    assert [name for name, _ in surface.calls] == ["from_engine_args", "shutdown"]
    assert surface.kwargs["AsyncEngineArgs"]["logprobs_mode"] == "processed_logprobs"


async def test_the_models_own_dtype_unless_told(surface: Surface, tmp_path: Path) -> None:
    """An fp32 model is run in fp32 (vLLM's ``auto`` is bfloat16 on CPU); ``dtype`` overrides it,
    and a model without a readable config gets vLLM's ``auto``."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "torch_dtype": "float32"}')
    for dtype, expected in (("model", "float32"), ("bfloat16", "bfloat16")):
        async with VLLMEngine(tmp_path, dtype=dtype):
            assert surface.kwargs["AsyncEngineArgs"]["dtype"] == expected
    async with VLLMEngine("/models/nowhere"):
        assert surface.kwargs["AsyncEngineArgs"]["dtype"] == "auto"


async def test_generate_sends_token_ids_and_sampling_params_vllm_knows(surface: Surface, engine: VLLMEngine) -> None:
    surface.outputs = [
        _delta(surface, [(5, {5: -0.5, 9: -0.1}), (6, {6: -0.2})], None),
        _delta(surface, [(7, {7: -1.5, 8: -1.0})], "length"),
    ]
    params = SamplingParams(
        max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=1, top_logprobs=1, stop_token_ids=frozenset({2})
    )
    steps = [step async for step in engine.generate("r1", [1, 2, 3], params)]

    assert [s.token_ids for s in steps] == [(5, 6), (7,)]
    assert [s.logprobs for s in steps] == [(-0.5, -0.2), (-1.5,)]
    assert [s.top_logprobs for s in steps] == [(((9, -0.1),), ((6, -0.2),)), (((8, -1.0),),)]
    assert [s.finish_reason for s in steps] == [None, "length"]
    generate = next(bound for name, bound in surface.calls if name == "generate")
    assert generate["prompt"] == {"type": "token", "prompt_token_ids": [1, 2, 3]}
    assert generate["request_id"] == "r1"
    sent = surface.kwargs["SamplingParams"]
    assert (sent["logprobs"], sent["top_k"], sent["stop_token_ids"], sent["detokenize"]) == (1, 5, [2], False)
    assert "abort" not in [name for name, _ in surface.calls]  # a finished request is not aborted


async def test_closing_the_stream_early_aborts_the_vllm_request(surface: Surface, engine: VLLMEngine) -> None:
    surface.outputs = [_delta(surface, [(5, {5: -0.5})], None), _delta(surface, [(6, {6: -0.5})], None)]
    stream = engine.generate("r2", [1, 2, 3], SamplingParams(max_tokens=8))
    assert (await anext(stream)).token_ids == (5,)
    await stream.aclose()
    assert ("abort", {"request_id": "r2"}) in surface.calls
    assert engine.statistics().active_requests == 0


async def test_load_weights_takes_the_recorded_reload_path(surface: Surface, engine: VLLMEngine) -> None:
    surface.calls.clear()
    report = await engine.load_weights("/checkpoints/step-4", 4)

    assert (report.policy_version, report.previous_version, engine.policy_version) == (4, 0, 4)
    assert [name for name, _ in surface.calls] == [
        "pause_generation",
        "collective_rpc",
        "reload_weights",  # Worker.reload_weights(*args, **kwargs)
        "reload_weights",  # GPUModelRunner.reload_weights(weights_iterator, weights_path, ...)
        "reset_prefix_cache",
        "resume_generation",
    ]
    bound = [bound for _, bound in surface.calls]
    assert (bound[0]["mode"], bound[0]["clear_cache"]) == ("keep", False)
    assert bound[3]["weights_path"] == "/checkpoints/step-4"
    assert bound[4]["reset_running_requests"] is True


_ERRORS = [
    ("VLLMValidationError", InvalidRequest),
    ("EngineDeadError", EngineUnavailable),
    ("RetryableRequestError", EngineUnavailable),
    ("GracefulHTTPError", EngineUnavailable),
    ("EngineGenerateError", EngineError),
]


def _has(record: Path, name: str) -> bool:
    return any(name in names for names in json.loads(record.read_text())["names"].values())


@pytest.mark.parametrize(
    ("surface", "raised", "expected"),
    # Only the errors each release has: RetryableRequestError and GracefulHTTPError are newer than 0.27.1.
    [pytest.param(r, n, e, id=f"{r.stem}-{n}") for r in RECORDS for n, e in _ERRORS if _has(r, n)],
    indirect=["surface"],
)
async def test_vllm_errors_become_gateway_errors(
    surface: Surface, engine: VLLMEngine, raised: str, expected: type[Exception]
) -> None:
    module = next(m for m, names in surface.record["names"].items() if raised in names)
    surface.error = getattr(sys.modules[module], raised)("refused")
    with pytest.raises(expected) as caught:
        [step async for step in engine.generate("r3", [1, 2, 3], SamplingParams(max_tokens=2))]
    assert type(caught.value) is expected


def test_the_records_span_the_vllm_extra_and_the_engine_names_the_newest() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    lowest = re.fullmatch(r"vllm>=([\d.]+)", extra[0])
    assert lowest, extra
    versions = [json.loads(p.read_text())["vllm"] for p in RECORDS]
    assert versions == [p.stem for p in RECORDS]
    assert versions[0] == lowest[1], "record the vLLM release the extra's lower bound names"
    doc = " ".join((vllm_engine.__doc__ or "").split())
    assert f"checked against vLLM {versions[-1]}'s source" in doc
    assert f"and against {versions[0]}'s, the oldest the ``vllm`` extra allows" in doc
