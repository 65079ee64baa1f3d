"""The operator's routes: weights, LoRA adapters (load, unload), inference servers, models,
erasure (``/admin/forget``), health and metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
from fastapi import APIRouter, Request
from pipeline.connection import NatsAuth
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from stream_gateway._errors import Conflict, ForgetFailed, InvalidRequest, NotFound, PolicyNotNewer, WeightsRejected
from stream_gateway.engines import UpstreamControl, normalize_url
from stream_gateway.engines.registry import ENGINES
from stream_gateway.http._body import parse_body
from stream_gateway.http._render import ORJSONResponse
from stream_gateway.http._state import GatewayState, gateway_state

__all__ = [
    "ForgetBody",
    "LoadLoraAdapterBody",
    "UnloadLoraAdapterBody",
    "UpstreamsBody",
    "WeightsBody",
    "admin_bodies",
    "admin_router",
    "running_loop",
]

admin_router = APIRouter()


class WeightsBody(BaseModel):
    """``POST /policy/weights``: load a checkpoint as the next policy version."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="a directory of *.safetensors files (the engine's model)")
    policy_version: int = Field(strict=True, gt=0)
    adapter: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="a LoRA adapter's name: `path` is a PEFT adapter directory, the version that adapter's",
    )


class UpstreamsBody(BaseModel):
    """``POST /admin/upstreams``: servers to add to and remove from a remote engine's pool."""

    model_config = ConfigDict(extra="forbid")

    add: list[str] = Field(default_factory=list, max_length=256, description="server URLs to add")
    remove: list[str] = Field(default_factory=list, max_length=256, description="server URLs to take out")


class LoadLoraAdapterBody(BaseModel):
    """``POST /v1/load_lora_adapter``, vLLM's: load a PEFT adapter directory as adapter ``lora_name``."""

    model_config = ConfigDict(extra="ignore")  # as vLLM: fields of other versions of its API pass

    lora_name: str = Field("", max_length=256, description="the adapter's name: requests select it with model=")
    lora_path: str = Field(
        "", max_length=4096, description="a PEFT adapter directory (remote engines: at that path on every server too)"
    )
    load_inplace: bool = Field(
        False, description="load over an adapter of that name (its next version); without it, a name in use is a 400"
    )


class UnloadLoraAdapterBody(BaseModel):
    """``POST /v1/unload_lora_adapter``, vLLM's: remove adapter ``lora_name``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field("", max_length=256, description="the adapter to remove")
    lora_int_id: int | None = Field(None, description="vLLM's internal id: accepted and not used")


class ForgetBody(BaseModel):
    """``POST /admin/forget``: erase a session, or a tenant, from every store (docs/data-rights.md)."""

    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(None, min_length=1, max_length=128, description="the session to forget")
    tenant: str | None = Field(
        None, min_length=1, max_length=256, description="its tenant (key file name, or key); alone: all its sessions"
    )
    before: float | None = Field(None, description="only the sessions that began before this time (Unix seconds)")


admin_bodies: dict[str, type[BaseModel]] = {
    "/policy/weights": WeightsBody,
    "/admin/forget": ForgetBody,
    "/admin/upstreams": UpstreamsBody,
    "/v1/load_lora_adapter": LoadLoraAdapterBody,
    "/v1/unload_lora_adapter": UnloadLoraAdapterBody,
}


@admin_router.post("/policy/weights")
async def load_weights(request: Request) -> Response:
    state = gateway_state(request)
    state.auth.admin(request, "weight updates")
    body = await parse_body(request, WeightsBody, state.settings.max_request_bytes)
    if not await anyio.Path(body.path).is_dir():
        raise InvalidRequest(f"No directory `{body.path}` on the gateway's machine.", param="path")
    if body.adapter is not None:
        return await _load_adapter(state, body, body.adapter)
    try:
        report = await state.applier.apply_directory(body.path, body.policy_version, source=body.path)
    except PolicyNotNewer as exc:
        raise Conflict(
            f"policy_version must be above the current {state.engine.policy_version}.",
            param="policy_version",
            code="stale_policy_version",
        ) from exc
    except (WeightsRejected, OSError) as exc:  # unreadable or mismatched checkpoint
        raise InvalidRequest(f"The engine could not load `{body.path}`: {exc}", param="path") from exc
    result = {"object": "policy", "policy_version": report.policy_version, "previous_version": report.previous_version}
    return ORJSONResponse(
        result | {"weights": body.path, "pause_s": report.pause_s, "copy_s": report.copy_s, "replica": state.replica}
    )


async def _load_adapter(state: GatewayState, body: WeightsBody, name: str) -> Response:
    from stream_gateway._errors import AdapterRefused

    try:
        report = await state.applier.apply_adapter(name, body.path, body.policy_version)
    except PolicyNotNewer as exc:
        raise Conflict(str(exc), param="policy_version", code="stale_policy_version") from exc
    except AdapterRefused as exc:
        raise InvalidRequest(f"Adapter `{name}` refused ({exc.reason}): {exc}", param="path") from exc
    result = {"object": "adapter", "adapter": name, "policy_version": report.policy_version}
    return ORJSONResponse(
        result | {"previous_version": report.previous_version, "pause_s": report.pause_s, "replica": state.replica}
    )


# vLLM's dynamic LoRA routes (vllm/entrypoints/serve/lora/api_router.py and openai/models/serving.py):
# a gateway is a vLLM-compatible server for trainers and for another gateway's vllm-http engine.
# Their answers are vLLM's: 200 with a line of text, or vLLM's error body and status.


def _vllm_error(message: str, kind: str, status: int) -> Response:
    return ORJSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


@admin_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    from stream_gateway._errors import AdapterRefused
    from stream_gateway.lora import CONFIG_NAME

    state = gateway_state(request)
    state.auth.admin(request, "loading LoRA adapters")
    body = await parse_body(request, LoadLoraAdapterBody, state.settings.max_request_bytes)
    name, path, engine = body.lora_name, body.lora_path, state.engine
    if not name or not path:
        return _vllm_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
    current = engine.adapters.get(name)
    if current is not None and not body.load_inplace:
        return _vllm_error(
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True.",
            "InvalidUserInput",
            400,
        )
    if name == engine.model_id:
        return _vllm_error(f"'{name}' is the base model's name.", "InvalidUserInput", 400)
    if not await anyio.Path(path, CONFIG_NAME).is_file():
        return _vllm_error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
    # A new name is version 0 (as --lora loads them); loading in place makes the next version.
    version = 0 if current is None else current + 1
    try:
        await state.applier.apply_adapter(name, path, version)
    except PolicyNotNewer as exc:  # another load of this name came first
        return _vllm_error(str(exc), "InvalidUserInput", 400)
    except AdapterRefused as exc:  # vLLM answers 500 when the engine refuses an adapter
        return _vllm_error(f"Loading lora {name} failed ({exc.reason}): {exc}", "InternalServerError", 500)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


@admin_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state = gateway_state(request)
    state.auth.admin(request, "unloading LoRA adapters")
    body = await parse_body(request, UnloadLoraAdapterBody, state.settings.max_request_bytes)
    name = body.lora_name
    if not name:
        return _vllm_error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
    unload = getattr(state.engine, "unload_adapter", None)
    if unload is None or name not in state.engine.adapters:
        return _vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
    try:
        await unload(name)
    except KeyError:
        return _vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
    except Conflict as exc:  # requests still use it (the transformers engine)
        return _vllm_error(exc.message, "ConflictError", 409)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


def _upstreams(state: GatewayState) -> UpstreamControl:
    upstreams = state.engine.upstreams
    if upstreams is None:
        raise NotFound(
            f"The {state.engine.name} engine has no inference servers to manage (only "
            f"{' and '.join(name for name, entry in ENGINES.items() if entry.pool)} do).",
            code="no_upstreams",
        )
    return upstreams


@admin_router.get("/admin/upstreams")
async def list_upstreams(request: Request) -> Response:
    state = gateway_state(request)
    state.auth.admin(request, "managing inference servers")
    return ORJSONResponse({"object": "list", "data": _upstreams(state).describe_upstreams()})


@admin_router.post("/admin/upstreams")
async def change_upstreams(request: Request) -> Response:
    state = gateway_state(request)
    state.auth.admin(request, "managing inference servers")
    upstreams = _upstreams(state)
    body = await parse_body(request, UpstreamsBody, state.settings.max_request_bytes)
    for url in [*body.add, *body.remove]:
        normalize_url(url)  # refuse the whole request before changing anything
    removed = [u.url for u in (upstreams.remove_upstream(url) for url in body.remove) if u is not None]
    added = []
    for url in body.add:
        upstream, new = await upstreams.add_upstream(url)
        if new:
            added.append(upstream.url)
    data = upstreams.describe_upstreams()
    return ORJSONResponse({"object": "list", "added": added, "removed": removed, "data": data})


@admin_router.post("/admin/forget")
async def forget(request: Request) -> Response:
    """``stream-gateway forget`` on behalf of an admin: the sessions it names end here first, then
    the command (a process of its own, with this gateway's NATS options) erases them everywhere;
    its receipts are the answer."""
    state = gateway_state(request)
    state.auth.admin(request, "erasing users' data")
    body = await parse_body(request, ForgetBody, state.settings.max_request_bytes)
    if body.session_id is None and body.tenant is None:
        raise InvalidRequest("Name what to forget: session_id and/or tenant.", param="session_id")
    settings = state.settings
    if settings.nats_url is None:
        raise InvalidRequest("This gateway captures nothing (no --nats-url): there is nothing to erase.")
    if body.tenant is not None and body.before is None:  # live sessions end here at once, before the tombstone
        from pipeline.tombstones import session_tombstone, tenant_tombstone, tokens

        tenant_token, session_token = tokens(body.tenant, body.session_id)
        if session_token is None:
            state.sessions.forgotten(tenant_tombstone(tenant_token))
        else:
            state.sessions.forgotten(session_tombstone(tenant_token, session_token))
    return await _run_forget(settings.nats_url, settings.nats_auth(), body)


async def _run_forget(nats_url: str, auth: NatsAuth, body: ForgetBody) -> Response:
    """Run ``stream-gateway forget``; its receipts (200), or why it refused or stopped."""
    import json
    import os
    import sys
    from dataclasses import fields

    command = [sys.executable, "-m", "stream_stack", "forget", "--nats-url", nats_url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_GATEWAY_NATS_")}
    for field in fields(auth):
        value = getattr(auth, field.name)
        if value is None:
            continue
        if field.name in ("password", "token"):  # secrets by environment, never on a command line
            env[f"STREAM_GATEWAY_NATS_{field.name.upper()}"] = str(value)
        else:
            command += [f"--nats-{field.name.replace('_', '-')}", str(value)]
    if body.session_id is not None:
        command += ["--session", body.session_id]
    if body.tenant is not None:
        command += ["--tenant", body.tenant]
    if body.before is not None:
        command += ["--before", repr(body.before)]
    with anyio.fail_after(600):
        done = await anyio.run_process(command, env=env, check=False)
    said = done.stderr.decode(errors="replace").strip().splitlines()
    reason = said[-1].removeprefix("stream-gateway: ").removeprefix("forget: ") if said else "no reason given"
    if done.returncode == 2:
        raise Conflict(reason, param="tenant")
    if done.returncode != 0:
        raise ForgetFailed(reason)
    parser, text, receipts = json.JSONDecoder(), done.stdout.decode().strip(), []
    while text:
        receipt, end = parser.raw_decode(text)
        receipts.append(receipt)
        text = text[end:].strip()
    return ORJSONResponse({"object": "list", "data": receipts})


@admin_router.get("/v1/models")
@admin_router.get("/sessions/{session_id}/v1/models")
async def list_models(request: Request) -> Response:
    state = gateway_state(request)
    tenant = state.auth.tenant(request)
    engine = state.engine
    model = {
        "id": engine.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "stream-gateway",
        "root": engine.model_id,
        "parent": None,
        "max_model_len": engine.max_model_len,
    }
    # LoRA adapters as vLLM lists them (``parent``: the base); another tenant's are not shown.
    owner = state.auth.keyring.adapter_owner
    adapters = [
        {**model, "id": name, "parent": engine.model_id, "policy_version": version}
        for name, version in engine.adapters.items()
        if owner(name) in (None, tenant)
    ]
    return ORJSONResponse({"object": "list", "data": [model, *adapters]})


@admin_router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root(request: Request) -> Response:
    """Claude Code opens a connection with ``HEAD /`` before its first request."""
    return ORJSONResponse({"object": "stream-gateway", "model": gateway_state(request).engine.model_id})


@admin_router.get("/health")
async def health(request: Request) -> Response:
    state = gateway_state(request)
    engine = state.engine
    stats = engine.statistics()
    body: dict[str, Any] = {
        "status": "ok" if stats.running else "unavailable",
        "engine": engine.name,
        "model": engine.model_id,
        "policy_version": engine.policy_version,
        "replica": state.replica,
        "server": {"loop": running_loop(), "http": state.settings.server_stack()[1]},
        "active_requests": stats.active_requests,
        "waiting_requests": stats.waiting_requests,
        "total_requests": stats.total_requests,
        "total_generated_tokens": stats.total_generated_tokens,
        "engine_recoveries": stats.recoveries,
        "engine_last_fault": stats.last_fault,
    }
    if engine.upstreams is not None:
        body["upstreams"] = [
            {"url": u.url, "healthy": u.healthy, "outstanding": u.outstanding} for u in engine.upstreams.upstream_list()
        ]
    if (publisher_stats := state.metrics.publisher_statistics()) is not None:
        body["events"] = {
            "connected": publisher_stats.connected,
            "pending": publisher_stats.pending,
            "outbox": publisher_stats.outbox,
        }
    return ORJSONResponse(body, status_code=200 if stats.running else 503)


@admin_router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    metrics = gateway_state(request).metrics
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def running_loop() -> str:
    """The running event loop's implementation: ``uvloop`` or ``asyncio``."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
