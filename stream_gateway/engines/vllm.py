"""The ``vllm`` engine: vLLM's in-process V1 ``AsyncLLM``, token ids in, token ids out.

vLLM is an optional extra (``pip install 'stream-gateway[vllm]'``) and needs a GPU, so nothing
here imports it at module import time; :class:`VLLMEngine` looks for it when constructed and
imports it when entered.

Every vLLM call here was checked against vLLM 0.33.0's source (the newest release; its wheel's
``vllm/v1/engine/async_llm.py``, ``vllm/engine/arg_utils.py``, ``vllm/sampling_params.py``,
``vllm/inputs/engine.py``, ``vllm/outputs.py``, ``vllm/v1/worker/gpu_worker.py``) and against
0.27.1's, the oldest the ``vllm`` extra allows. tests/unit/vllm_api/ records both surfaces with
file and line (``scripts/record_vllm_api.py``) and tests/unit/test_vllm_calls.py drives this
engine against each; ``scripts/check-vllm-resolves`` checks that pip can still install the newest
vLLM beside this project. The pre-0.16 reload path was written against 0.10.2 and is not tested.
Where this module deliberately differs from how vLLM's OpenAI server drives the same engine:

- ``logprobs_mode="processed_logprobs"``: vLLM defaults to raw logprobs (before temperature and
  top-k/top-p); RL needs the distribution each token was actually drawn from.
- ``logprobs=N`` always, N = the requested top alternatives (0 is allowed): vLLM then returns the
  sampled token's logprob plus the N most likely, as one ``{token_id: Logprob}`` dict per token.
- ``detokenize=False``: the gateway decodes text itself from the ids it streams; vLLM's detokenizer
  would be wasted work, and stop *strings* (which need it) are never sent to the engine.
- The tokenizer is loaded with ``AutoTokenizer`` rather than taken from vLLM, because vLLM's
  ``get_tokenizer()`` changed from async to sync across releases and may wrap the HF tokenizer.
- The engine is built synchronously inside ``__aenter__``, as vLLM's own API server does: a
  worker thread would make vLLM fork its engine process from a non-main thread.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
from pipeline.vision import ProcessedImage, VisionProcessor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway._errors import ContextLengthExceeded, EngineError, EngineUnavailable, InvalidRequest
from stream_gateway.engines._base import (
    EngineStatistics,
    EngineStep,
    ExpertShape,
    SamplingParams,
    UpstreamControl,
    WeightUpdateReport,
)

if TYPE_CHECKING:
    import torch

    from stream_gateway._settings import Settings

__all__ = ["VLLMEngine", "create_engine", "engine_options", "model_dtype"]

logger = logging.getLogger(__name__)

_MISSING = "the vllm engine needs `pip install 'stream-gateway[vllm]'` and a GPU"
# ``reload_weights(weights_path=...)`` and ``pause_generation(mode="keep")`` exist from 0.16;
# ``reset_prefix_cache`` can preempt running requests (so none keeps KV blocks computed by the old
# weights) from 0.13.
_RELOAD_FROM_PATH = (0, 16)
_RESET_RUNNING = (0, 13)
# ``AsyncLLM.generate`` takes a rendered engine input (``vllm.inputs.tokens_input``) in 0.27.1 and
# 0.33.0; the releases between 0.16 and 0.27 were not read.
_ENGINE_INPUT = (0, 27)


def model_dtype(model: str) -> str:
    """The dtype a local model's ``config.json`` declares (``torch_dtype``, or transformers 5's
    ``dtype``), as vLLM names it; ``auto`` when there is none to read."""
    config = Path(model) / "config.json"
    try:
        declared = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError):
        return "auto"
    value = declared.get("dtype") or declared.get("torch_dtype") if isinstance(declared, dict) else None
    return value if value in ("float32", "bfloat16", "float16") else "auto"


class VLLMEngine:
    """An :class:`~stream_gateway.engines._base.Engine` backed by vLLM's in-process ``AsyncLLM``.

    ``engine_kwargs`` go to ``AsyncEngineArgs`` unchanged (``dtype``, ``enforce_eager``, ``seed``,
    ``tensor_parallel_size``...); the keyword arguments named here win over them, and
    ``logprobs_mode`` is always ``"processed_logprobs"`` because capture depends on it.

    ``dtype`` is vLLM's (``auto``, ``float32``, ``bfloat16``, ``float16``), or ``model`` (the
    default): the dtype the model's ``config.json`` declares, so an fp32 model is sampled in fp32
    and its recorded logprobs are its forward pass's (vLLM's ``auto`` picks bfloat16 on CPU: 4e-3
    away on the tiny model, tests/gateway/test_engine_vllm_cpu.py); ``auto`` where the config says
    nothing or is not a local directory.
    """

    name = "vllm"
    remote = False
    constrained_decoding = False
    experts: ExpertShape | None = None
    vision: VisionProcessor | None = None  # text only (docs/images.md)
    adapters: Mapping[str, int] = MappingProxyType({})  # no LoRA on this engine
    upstreams: UpstreamControl | None = None

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.85,
        max_logprobs: int = 20,
        dtype: str = "model",
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        # Fail at construction (e.g. ``--engine vllm`` on a CPU box), not on the first request.
        if importlib.util.find_spec("vllm") is None:
            raise EngineUnavailable(_MISSING)
        self.model = os.fspath(model)
        self.model_id = served_model_name or self.model
        self.max_model_len = max_model_len or 0  # the real value is read from vLLM on enter
        self.policy_version = 0
        self.tokenizer: PreTrainedTokenizerBase
        self._max_logprobs = max_logprobs
        self._engine_args: dict[str, Any] = {
            "dtype": model_dtype(self.model) if dtype == "model" else dtype,
            **(engine_kwargs or {}),
            "model": self.model,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_logprobs": max_logprobs,
            "logprobs_mode": "processed_logprobs",
        }
        if served_model_name is not None:
            self._engine_args["served_model_name"] = served_model_name
        if max_model_len is not None:
            self._engine_args["max_model_len"] = max_model_len
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once entered
        self._version = (0, 0)
        self._client_errors: tuple[type[BaseException], ...] = (ValueError,)
        self._dead_errors: tuple[type[BaseException], ...] = ()
        self._busy_errors: tuple[type[BaseException], ...] = ()
        self._reload_lock = anyio.Lock()
        self._active = 0
        self._waiting = 0
        self._total_requests = 0
        self._total_tokens = 0

    async def __aenter__(self) -> VLLMEngine:
        try:
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError as exc:
            raise EngineUnavailable(_MISSING) from exc
        try:
            from vllm import exceptions as vllm_errors
        except ImportError:
            vllm_errors = None
        # Request validation errors are ValueErrors up to ~0.2x, VLLMClientError after.
        self._client_errors = (ValueError, *_classes(vllm_errors, "VLLMClientError"))
        # 0.33 raises these from generate() as they are (0.27 wraps every server-side error in
        # EngineGenerateError): a full queue (max_num_queued_reqs/tokens, off by default) and a
        # request refused while paused in "abort"/"wait" mode, 503s that the client may retry.
        self._busy_errors = _classes(vllm_errors, "GracefulHTTPError", "RetryableRequestError")
        self._dead_errors = (EngineDeadError,)
        self._version = _release(vllm.__version__)

        self.tokenizer = AutoTokenizer.from_pretrained(
            self._engine_args.get("tokenizer") or self.model,
            trust_remote_code=bool(self._engine_args.get("trust_remote_code", False)),
        )
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args))
        except Exception as exc:
            raise EngineUnavailable(f"vLLM failed to start {self.model!r}: {exc}") from exc
        self.max_model_len = int(self._llm.model_config.max_model_len)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            # Stops the engine-core process and its output task; in-flight generators then fail.
            llm.shutdown()

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        affinity: str | None = None,
        images: Sequence[ProcessedImage] = (),
    ) -> AsyncGenerator[EngineStep, None]:
        """Stream vLLM's DELTA outputs as steps; closing this iterator aborts the vLLM request."""
        if images:  # the preparer refuses them first (vision is None): never sample without them
            raise EngineError(f"the {self.name} engine does not take images")
        llm = self._llm
        if llm is None:
            raise EngineUnavailable("the vllm engine is not running")
        if len(prompt_ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens and the completion needs at least one"
            )
        if params.top_logprobs > self._max_logprobs:
            raise InvalidRequest(f"top_logprobs may be at most {self._max_logprobs}", param="top_logprobs")
        prompt = self._vllm_prompt(prompt_ids)
        self._total_requests += 1
        self._waiting += 1
        started = False
        try:
            # ``aclosing``: our own early close must close vLLM's generator now, not at garbage
            # collection: its GeneratorExit/CancelledError handler is what aborts the request.
            async with aclosing(llm.generate(prompt, self._vllm_params(params), request_id)) as outs:
                while True:
                    try:
                        output = await anext(outs)
                    except StopAsyncIteration:
                        return
                    except self._client_errors as exc:
                        raise InvalidRequest(str(exc)) from exc
                    except self._dead_errors as exc:
                        raise EngineUnavailable(f"the vLLM engine died: {exc}") from exc
                    except self._busy_errors as exc:
                        raise EngineUnavailable(f"vLLM refused request {request_id} for now: {exc}") from exc
                    except Exception as exc:  # EngineGenerateError and anything unforeseen
                        raise EngineError(f"vLLM failed request {request_id}: {exc!r}") from exc
                    if not started:
                        started = True
                        self._waiting -= 1
                        self._active += 1
                    step = _to_step(output.outputs[0], params.top_logprobs, self.policy_version)
                    if step is None:  # an abort we did not cause through this iterator
                        return
                    self._total_tokens += len(step.token_ids)
                    if step.finish_reason is not None:
                        # Let vLLM's generator end by itself before our consumer can close us:
                        # closing it after its last output would send a needless abort.
                        async for _ in outs:
                            pass
                        # RequestOutput.num_cached_tokens: the prompt tokens its prefix cache served.
                        cached = getattr(output, "num_cached_tokens", None)
                        yield replace(step, cached_prompt_tokens=cached) if isinstance(cached, int) else step
                        return
                    yield step
        finally:
            if started:
                self._active -= 1
            else:
                self._waiting -= 1

    async def update_weights(self, tensors: Mapping[str, torch.Tensor], policy_version: int) -> WeightUpdateReport:
        """Write ``tensors`` as one safetensors file in a temporary directory and :meth:`load_weights` it.

        vLLM's ``reload_weights`` reads checkpoints from disk; a full state dict is expected (a
        partial one is applied only as far as vLLM's loader accepts it).
        """
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="sg-weights-") as directory:
            contiguous = {name: t.contiguous() for name, t in tensors.items()}
            await anyio.to_thread.run_sync(save_file, contiguous, str(Path(directory) / "model.safetensors"))
            return await self.load_weights(directory, policy_version)

    async def load_weights(self, path: str, policy_version: int) -> WeightUpdateReport:
        """Reload the weights in place from a checkpoint directory, then drop the prefix cache.

        vLLM >= 0.16 (its documented async-RL recipe): ``pause_generation(mode="keep")`` freezes
        requests in flight, ``collective_rpc("reload_weights", kwargs={"weights_path": path})``
        loads, ``reset_prefix_cache(reset_running_requests=True)`` drops every KV block the old
        weights computed (frozen requests are recomputed), ``resume_generation()``. Older releases
        have no keep-mode pause: ``collective_rpc("update_config", ...)`` points the workers at
        ``path`` and ``collective_rpc("reload_weights")`` loads, between two scheduler steps.
        """
        llm = self._llm
        if llm is None:
            raise EngineUnavailable("the vllm engine is not running")
        previous = self.policy_version
        async with self._reload_lock:
            started = time.perf_counter()
            try:
                if self._version >= _RELOAD_FROM_PATH:
                    await llm.pause_generation(mode="keep", clear_cache=False)
                    try:
                        await llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
                        await llm.reset_prefix_cache(reset_running_requests=True)
                        # Bumped while paused: every token sampled after resuming is new-policy.
                        self.policy_version = policy_version
                    finally:
                        await llm.resume_generation()
                    pause = time.perf_counter() - started
                    return WeightUpdateReport(policy_version, previous, 0, pause, pause, self._active)
                overrides = {"model_config": {"model": path, "revision": None}}
                await llm.collective_rpc("update_config", args=(overrides,))
                await llm.collective_rpc("reload_weights")
                if self._version >= _RESET_RUNNING:
                    await llm.reset_prefix_cache(reset_running_requests=True)
                elif await llm.reset_prefix_cache() is False:
                    # 0.10-0.12 keep the cache while running requests hold blocks: cached
                    # prefixes from the old weights may then be reused until they are evicted.
                    logger.warning("vLLM kept its prefix cache after loading %s", path)
                self.policy_version = policy_version
                pause = time.perf_counter() - started
                return WeightUpdateReport(policy_version, previous, 0, pause, pause, self._active)
            except Exception as exc:
                raise EngineError(f"vLLM could not load weights from {path!r}: {exc}") from exc

    def statistics(self) -> EngineStatistics:
        """A snapshot: ``waiting_requests`` are before their first token (queued or prefilling),
        ``active_requests`` are streaming; a request leaves both when its iterator closes."""
        return EngineStatistics(
            active_requests=self._active,
            waiting_requests=self._waiting,
            total_requests=self._total_requests,
            total_generated_tokens=self._total_tokens,
        )

    def _vllm_prompt(self, prompt_ids: Sequence[int]) -> Any:
        """The prompt as vLLM's engine input: an already tokenized ``tokens_input`` from 0.27.

        A ``TokensPrompt`` (a "raw prompt") still works but goes through vLLM's renderer, which
        0.27.1 and 0.33.0 log as deprecated ("Passing raw prompts to InputProcessor is deprecated");
        a ``{"type": "token", ...}`` input skips it, and the token ids and the prompt length are
        validated the same way (``InputProcessor._validate_model_input``).
        """
        if self._version >= _ENGINE_INPUT:
            from vllm.inputs import tokens_input

            return tokens_input(list(prompt_ids))
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(prompt_ids))

    def _vllm_params(self, params: SamplingParams) -> Any:
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=1,
            temperature=params.temperature,  # 0 is greedy in vLLM too
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables top-k in vLLM >= 0.10 (-1 is accepted as well)
            seed=params.seed,
            max_tokens=params.max_tokens,
            logprobs=params.top_logprobs,  # 0: only the sampled token's logprob
            stop_token_ids=sorted(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            skip_special_tokens=False,
        )


def _classes(module: Any, *names: str) -> tuple[type[BaseException], ...]:
    """The exception classes of ``names`` that ``module`` defines (a release may lack some)."""
    return tuple(getattr(module, name) for name in names if hasattr(module, name))


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string; an unparseable dev build counts as the newest."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (9999, 0)


def _to_step(completion: Any, top_n: int, policy_version: int = 0) -> EngineStep | None:
    """Map one vLLM ``CompletionOutput`` delta to an :class:`EngineStep` (None for an abort).

    vLLM puts the sampled token first in each position's dict, then the top-N in rank order; a
    sampled token that is also in the top-N appears once. So the top-N are re-sorted by logprob.
    """
    reason = completion.finish_reason
    if reason == "abort":
        return None
    if reason not in (None, "stop", "length"):  # "error" in newer releases, or anything unknown
        raise EngineError(f"vLLM ended the request with finish_reason={reason!r}")
    token_ids = tuple(int(t) for t in completion.token_ids)
    positions = list(completion.logprobs or ())
    if len(positions) != len(token_ids):
        raise EngineError(f"vLLM returned {len(positions)} logprobs for {len(token_ids)} tokens")
    logprobs = tuple(float(pos[tid].logprob) for tid, pos in zip(token_ids, positions, strict=True))
    top: tuple[tuple[tuple[int, float], ...], ...] | None = None
    if top_n > 0:
        top = tuple(
            tuple(
                (int(tid), float(lp.logprob))
                for tid, lp in sorted(pos.items(), key=lambda item: -item[1].logprob)[:top_n]
            )
            for pos in positions
        )
    return EngineStep(
        token_ids=token_ids, logprobs=logprobs, top_logprobs=top, finish_reason=reason, policy_version=policy_version
    )


def engine_options(name: str, settings: Settings) -> dict[str, Any]:
    """The engine's constructor arguments from a process's settings (see :mod:`.registry`)."""
    from stream_gateway.engines._build import default_name

    return {
        "served_model_name": settings.served_model_name or default_name(settings.model),
        "max_model_len": settings.max_model_len,
        "dtype": settings.dtype,
    }


def create_engine(name: str, model: str | Path, **options: Any) -> VLLMEngine:
    """A :class:`VLLMEngine` on ``model`` (see :mod:`.registry`)."""
    return VLLMEngine(model, **options)
