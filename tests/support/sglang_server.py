"""A stand-in for an SGLang server (not SGLang): its native HTTP protocol, sampling with a tiny model.

SGLang needs a GPU, so the ``sglang-http`` engine cannot be tested against a real SGLang server
on this machine. This server implements the part of SGLang's protocol the engine uses, as SGLang
documents and implements it (``python/sglang/srt/entrypoints/http_server.py``,
``GenerateReqInput`` in ``managers/io_struct.py``, ``SamplingParams`` in
``sampling/sampling_params.py`` as of sglang commit 00c17cafcb9e; see ``docs/engines.md``):

* ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``,
  ``top_p``, ``top_k`` with -1 for off, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``),
  ``return_logprob``, ``top_logprobs_num``, ``logprob_start_len``, ``stream``, ``rid``. Streamed
  as ``data: {json}\\n\\n`` frames, then ``data: [DONE]``. Each frame holds ``text``,
  ``output_ids`` and ``meta_info`` (``id``, ``finish_reason`` as ``None`` or
  ``{"type": "stop"|"length"|"abort", ...}``, ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``, ``weight_version``, ``output_token_logprobs`` as ``[logprob, token_id, None]``
  triples, ``output_top_logprobs``). By default a frame holds everything so far (SGLang's
  default); with ``incremental=True`` only the new part (``--incremental-streaming-output``).
* Routed experts of a mixture of experts, as SGLang 0.5.12-0.5.23 returns them (read in its wheels:
  ``managers/io_struct.py``, ``managers/scheduler.py``, ``managers/tokenizer_manager.py``,
  ``state_capturer/routed_experts.py``): with ``return_routed_experts: true`` the final frame's
  ``meta_info.routed_experts`` is base64 of the raw little-endian int32 ids of positions
  ``[routed_experts_start_len, prompt + output - 1)`` (``[rows, layers, top_k]`` flattened; no
  shape is sent). A start outside ``[0, prompt length]`` aborts the request, as SGLang's
  scheduler does. Like a server started with ``--enable-return-routed-experts``; a dense model
  sends none.
* ``GET /health``, ``GET /get_model_info``, ``GET /v1/models``.
* ``POST /update_weights_from_disk`` (``model_path``, ``weight_version``).
* LoRA adapters, as SGLang's dynamic loading does (``http_server.py``'s ``/load_lora_adapter`` and
  ``/unload_lora_adapter``, ``LoadLoRAAdapterReqInput``/``LoRAUpdateOutput`` in ``io_struct.py``,
  ``lora/lora_registry.py``, ``LoRAManager.validate_new_adapter``): ``POST /load_lora_adapter``
  ``{"lora_name", "lora_path"}`` and ``POST /unload_lora_adapter`` ``{"lora_name"}`` answer
  ``{"success", "error_message", "loaded_adapters"}``, 200 or 400 (a name loaded already: "Failed to
  load LoRA adapter NAME because it is already loaded"; an engine without LoRA: "LoRA is not
  enabled..."). An unload first stops new requests on the adapter, then waits for those in flight.
  ``/generate``'s ``lora_path`` names a loaded adapter; an unknown one ends the stream with SGLang's
  error frame (``{"error": {"message": "The following requested LoRA adapters are not loaded:
  ..."}}``, status 200). The engine must have been built with ``loras=`` to hold adapters.

The sampling itself is our ``transformers`` engine (or its subclass the ``scripted`` engine, where a
test needs a particular answer, such as tiny-agent's tool call, from an untrained model), so what
the gateway records through this server can be checked against a forward pass like any other
engine's output.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from stream_gateway._errors import AdapterRefused, Conflict
from stream_gateway.engines import SamplingParams
from stream_gateway.engines.transformers import TransformersEngine


def _health(delay: Callable[[], float] | None) -> Callable[[Request], Awaitable[Response]]:
    """``GET /health``: 200, after ``delay()`` seconds when given."""

    async def health(_: Request) -> Response:
        if delay is not None:
            await asyncio.sleep(delay())
        return Response(status_code=200)

    return health


def create_sglang_app(
    engine: TransformersEngine,
    *,
    incremental: bool = False,
    abort_after: int | None = None,
    health_delay: Callable[[], float] | None = None,
) -> Starlette:
    """The app; ``abort_after`` makes every request end with ``finish_reason.type == "abort"``
    after that many tokens (as SGLang reports a request it aborted); ``health_delay``: seconds
    ``GET /health`` waits before it answers, asked at each check (a server busy with its streams)."""
    state = {"weight_version": "default"}
    adapters = _Adapters(engine)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with engine:
            yield

    health = _health(health_delay)

    async def model_info(_: Request) -> Response:
        body = {"model_path": engine.model_id, "tokenizer_path": engine.model_id, "is_generation": True,
                "weight_version": state["weight_version"]}  # fmt: skip
        return Response(orjson.dumps(body), media_type="application/json")

    async def models(_: Request) -> Response:
        card = {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "sglang", "root": engine.model_id,
                "max_model_len": engine.max_model_len}  # fmt: skip
        return Response(orjson.dumps({"object": "list", "data": [card]}), media_type="application/json")

    async def update_weights(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state["weight_version"] = str(body.get("weight_version") or state["weight_version"])
        return Response(orjson.dumps({"success": True, "message": "Succeeded in updating weights."}),
                        media_type="application/json")  # fmt: skip

    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        sampling = body.get("sampling_params") or {}
        prompt = list(body["input_ids"])
        top_n = int(body.get("top_logprobs_num") or 0)
        top_k = int(sampling.get("top_k", -1))
        params = SamplingParams(
            max_tokens=int(sampling.get("max_new_tokens", 128)),
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
            top_k=top_k if top_k > 0 else 0,
            seed=sampling.get("sampling_seed"),
            top_logprobs=top_n,
            stop_token_ids=frozenset(sampling.get("stop_token_ids") or ()),
            ignore_eos=bool(sampling.get("ignore_eos", False)),
            adapter=body.get("lora_path"),  # a loaded adapter's lora_name
        )
        rid = str(body.get("rid") or "rid")
        want_routes = bool(body.get("return_routed_experts"))
        routes_start = int(body.get("routed_experts_start_len") or 0)
        # Refused before running: an adapter not loaded (SGLang's LoRARegistry.acquire raises, the
        # stream carries the error), a routes start outside the prompt (SGLang's scheduler aborts it).
        refusal = adapters.refusal(params.adapter) or (
            _aborted(rid, len(prompt), f"routed_experts_start_len={routes_start} is outside [0, {len(prompt)}]")
            if want_routes and not 0 <= routes_start <= len(prompt)
            else None
        )

        async def frames() -> AsyncIterator[bytes]:
            ids: list[int] = []
            entries: list[list[Any]] = []
            tops: list[list[list[Any]]] = []
            routes: list[np.ndarray] = []
            sent = 0
            if refusal is not None:
                yield refusal
                return
            async with aclosing(engine.generate(rid, prompt, params)) as steps:
                async for step in steps:
                    if step.routes is not None:
                        routes.append(step.routes)
                    ids.extend(step.token_ids)
                    entries.extend([lp, t, None] for t, lp in zip(step.token_ids, step.logprobs, strict=True))
                    if top_n:
                        tops.extend([[lp, t, None] for t, lp in alts] for alts in step.top_logprobs or ())
                    finish: dict[str, Any] | None = None
                    if abort_after is not None and len(ids) >= abort_after:
                        finish = {"type": "abort", "message": "Abort request: the server is shutting down"}
                    elif step.finish_reason == "stop":
                        finish = {"type": "stop", "matched": ids[-1]}
                    elif step.finish_reason == "length":
                        finish = {"type": "length", "length": len(ids)}
                    start = sent if incremental else 0
                    meta = {
                        "id": rid,
                        "finish_reason": finish,
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(ids),
                        "cached_tokens": 0,
                        "weight_version": state["weight_version"],
                        "output_token_logprobs": entries[start:],
                        "output_top_logprobs": tops[start:] if top_n else [],
                    }
                    if want_routes and finish is not None and routes:
                        rows = np.concatenate(routes)[routes_start:].astype("<i4")
                        meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
                    text = engine.tokenizer.decode(ids[start:], skip_special_tokens=True)
                    frame = {"text": text, "output_ids": ids[start:], "meta_info": meta}
                    sent = len(ids)
                    yield b"data: " + orjson.dumps(frame) + b"\n\n"
                    if finish is not None:
                        break
            yield b"data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    routes = [
        Route("/health", health),
        Route("/get_model_info", model_info),
        Route("/v1/models", models),
        Route("/update_weights_from_disk", update_weights, methods=["POST"]),
        Route("/load_lora_adapter", adapters.load, methods=["POST"]),
        Route("/unload_lora_adapter", adapters.unload, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


class _Adapters:
    """SGLang's dynamic LoRA routes over the engine's adapters."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.paths: dict[str, str] = {}  # loaded adapters -> their directories
        self.closing: set[str] = set()  # adapters being unloaded: no new requests

    def serves(self, name: str) -> bool:
        return name in self.engine.adapters and name not in self.closing

    def refusal(self, name: str | None) -> bytes | None:
        """The error frame of a request on an adapter not loaded (None: the base, or a loaded one)."""
        if name is None or self.serves(name):
            return None
        message = f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {list(self.paths)}."
        return b"data: " + orjson.dumps({"error": {"message": message}}) + b"\n\ndata: [DONE]\n\n"

    def result(self, success: bool, error: str = "") -> Response:
        body = {"success": success, "error_message": error, "loaded_adapters": dict(self.paths)}
        return Response(orjson.dumps(body), status_code=200 if success else 400, media_type="application/json")

    async def load(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        name, path = str(body["lora_name"]), str(body["lora_path"])
        if name in self.engine.adapters:
            return self.result(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        try:
            await self.engine.load_adapter(name, path, 0)
        except AdapterRefused as exc:
            if exc.reason == "unsupported" and "--lora" in str(exc):  # an engine built without loras=
                return self.result(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
            return self.result(False, str(exc))
        self.paths[name] = path
        return self.result(True)

    async def unload(self, request: Request) -> Response:
        name = str(orjson.loads(await request.body())["lora_name"])
        if not self.serves(name):
            return self.result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.paths)}")
        self.closing.add(name)  # SGLang unregisters it first, then waits for the requests in flight
        try:
            while True:
                try:
                    await self.engine.unload_adapter(name)
                    break
                except Conflict:
                    await asyncio.sleep(0.05)
        finally:
            self.closing.discard(name)
        self.paths.pop(name, None)
        return self.result(True)


def _aborted(rid: str, prompt_tokens: int, message: str) -> bytes:
    """The frames of a request SGLang aborted before running it."""
    meta = {"id": rid, "finish_reason": {"type": "abort", "message": message}, "prompt_tokens": prompt_tokens,
            "completion_tokens": 0, "output_token_logprobs": [], "output_top_logprobs": []}  # fmt: skip
    return b"data: " + orjson.dumps({"text": "", "output_ids": [], "meta_info": meta}) + b"\n\ndata: [DONE]\n\n"
