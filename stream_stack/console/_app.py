"""The console's web app: one page (``static/``) and the JSON it reads, tenant-scoped by API key.

Signing in: ``POST /api/login`` with a key; the key is checked as the gateway checks it (the same
``--api-key``/``--key-file``/``--admin-api-key``), and the browser gets an opaque, random session
cookie (HttpOnly, SameSite=Strict, Secure over https), never the key, never in a URL. Every
``/api`` route needs that cookie; every state-changing one also needs the ``X-CSRF-Token`` header
the page got at sign-in (a cross-site form can send neither). A tenant's key sees its own sessions
only (their ids are its own: another tenant's same id is another session); an admin key sees all.

Everything users, tools and the model wrote reaches the page as JSON and is put into it as text
(``textContent``), and the Content-Security-Policy allows no inline script, so a reply holding
``<script>`` or ``javascript:`` is shown, never run.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from consumers.trajectory import HEALTH_FLAGS
from pipeline.events import decode_event, subject_token, tenant_id

from ._feed import Feed, read_message
from ._index import PAGE_LIMIT, ConsoleIndex, SessionFilter
from ._ratings import RatingBody, RatingError, send_rating
from ._tokens import KINDS, Tokenizers, TokenView

if TYPE_CHECKING:
    from stream_gateway.control import KeyRing

__all__ = ["COOKIE", "ConsoleApi", "create_console_app"]

log = logging.getLogger(__name__)

COOKIE = "sg_console"
_STATIC = Path(__file__).parent / "static"
_LOGIN_TTL_S = 12 * 3600.0
_TOKEN_PAGE = 2000
_VIEWS_KEPT = 4
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


class ConsoleError(Exception):
    """An OpenAI-style error body with its status."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


def _unauthorized(message: str = "Sign in with an API key.") -> ConsoleError:
    return ConsoleError(401, message, "authentication_error", "invalid_api_key")


def _not_found(what: str) -> ConsoleError:
    return ConsoleError(404, f"No {what}.", "invalid_request_error", "not_found")


@dataclass(frozen=True, slots=True)
class _Login:
    tenant: str | None  # the events' tenant id; None: an admin, who sees every tenant
    label: str  # what the page shows: the tenant id, or "admin"
    csrf: str
    expires: float
    key: str = field(default="", repr=False)  # kept here only, to rate through the gateway (_ratings.py)


class ConsoleApi:
    """What the routes share: the index, the feed (NATS), the tokenizers and the signed-in browsers."""

    def __init__(
        self,
        index: ConsoleIndex,
        feed: Feed | None,
        tokenizers: Tokenizers,
        keyring: KeyRing,
        admin_keys: Collection[str],
        *,
        batch_dirs: tuple[Path, ...] = (),
        gateway_url: str | None = None,
    ) -> None:
        self.index = index
        self.feed = feed
        self.tokenizers = tokenizers
        self._keyring = keyring
        self._admin_keys = frozenset(admin_keys)
        self._logins: dict[str, _Login] = {}
        self._views: OrderedDict[str, TokenView] = OrderedDict()
        self.batch_dirs = batch_dirs
        self.gateway_url = gateway_url  # where ratings go (its feedback route); None: the console cannot rate

    # -- signing in ------------------------------------------------------------------------------

    def login(self, key: str) -> tuple[str, _Login]:
        admin = bool(key) and key in self._admin_keys
        entry = self._keyring.entry(key)
        if entry is None and not admin:
            raise _unauthorized("Incorrect API key provided.")
        tenant = None if admin else tenant_id(entry.tenant if entry is not None else key)
        login = _Login(tenant, "admin" if admin else str(tenant), secrets.token_urlsafe(24), time.time() + _LOGIN_TTL_S,
                       key=key)  # fmt: skip
        token = secrets.token_urlsafe(32)
        now = time.time()
        self._logins = {t: v for t, v in self._logins.items() if v.expires > now}
        self._logins[token] = login
        return token, login

    def logout(self, token: str | None) -> None:
        if token is not None:
            self._logins.pop(token, None)

    def who(self, request: Request, *, changes: bool = False) -> _Login:
        login = self._logins.get(request.cookies.get(COOKIE) or "")
        if login is None or login.expires < time.time():
            raise _unauthorized()
        if changes and not secrets.compare_digest(request.headers.get("x-csrf-token", ""), login.csrf):
            raise ConsoleError(403, "Missing or wrong X-CSRF-Token.", "permission_error", "csrf")
        return login

    # -- trajectories ----------------------------------------------------------------------------

    async def view(self, login: _Login, trajectory_id: str) -> tuple[dict[str, Any], TokenView]:
        row = await anyio.to_thread.run_sync(self.index.trajectory, trajectory_id)
        if row is None or (login.tenant is not None and row["tenant"] != login.tenant):
            raise _not_found(f"trajectory `{trajectory_id}`")
        view = self._views.get(trajectory_id)
        if view is None or view.data.get("_seq") != row["seq"]:
            if self.feed is None:
                raise ConsoleError(503, "The console is not connected to NATS.", "server_error", "nats_unavailable")
            from nats.errors import Error as NatsError
            from nats.js.errors import NotFoundError

            try:
                payload = await read_message(self.feed.js, self.feed.names.trajectories, row["seq"])
            except (NotFoundError, LookupError) as exc:  # retention or a forget took it
                raise ConsoleError(
                    410, f"Trajectory `{trajectory_id}` is no longer in the stream ({exc!r}).", "invalid_request_error",
                    "gone",
                ) from exc  # fmt: skip
            except (NatsError, TimeoutError) as exc:
                raise ConsoleError(503, f"NATS did not answer ({exc!r}).", "server_error", "nats_unavailable") from exc
            data = orjson.loads(payload)
            data["_seq"] = row["seq"]
            tokenizer = self.tokenizers.get(data["model"])
            view = await anyio.to_thread.run_sync(TokenView, data, tokenizer)
            self._views[trajectory_id] = view
            while len(self._views) > _VIEWS_KEPT:
                self._views.popitem(last=False)
        self._views.move_to_end(trajectory_id)
        return row, view

    async def scores(self, row: dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]]:
        """The reward worker's verdicts on a trajectory (``sg_scores``: score, timeout or error, per
        scorer, a judge's answer kept); empty without NATS, a bucket or a verdict."""
        if self.feed is None:
            return []
        from nats.errors import Error as NatsError
        from nats.js.errors import BucketNotFoundError

        from consumers.scores import ScoreRecord, score_key
        from pipeline.kv import current_entries

        prefix = score_key(row["tenant"], data["session_id"], data["trajectory_id"], "")
        records: list[ScoreRecord] = []
        try:
            kv = await self.feed.js.key_value(self.feed.names.score_bucket)
            # The trajectory's keys, read whole (pipeline/kv.py: nats-py's own watch can end too early).
            for entry in (await current_entries(kv, prefix + "*")).values():
                if entry.value:
                    records.append(ScoreRecord.decode(entry.value))
        except BucketNotFoundError:
            return []
        except (NatsError, TimeoutError, ValueError) as exc:
            log.warning("scores of %s: %r", data["trajectory_id"], exc)
            return []
        records.sort(key=lambda r: r.scorer)
        return [
            r.model_dump(include={"scorer", "kind", "status", "score", "parts", "turns", "answer", "error", "attempts"})
            for r in records
        ]


def _error_response(exc: ConsoleError) -> JSONResponse:
    body = {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status)


def _number(request: Request, name: str, default: float | None = None, *, integer: bool = False) -> Any:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ConsoleError(
            400, f"`{name}` must be a number, got {raw!r}.", "invalid_request_error", param=name
        ) from None
    if value < 0:
        raise ConsoleError(400, f"`{name}` must not be negative.", "invalid_request_error", param=name)
    return value


def _asked(tokenizers: Tokenizers, model: str | None, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each turn with ``asked``: what was appended to its prompt before it (the user's message, tool
    results; a root: its whole prompt's tail), decoded as text without the template's special
    tokens; null without the model's tokenizer."""
    tokenizer = tokenizers.get(model) if model else None
    for turn in turns:
        ids = turn.pop("asked_ids")
        turn["asked"] = tokenizer.decode(ids, skip_special_tokens=True).strip() if tokenizer is not None else None
    return turns


def _tenant_of(login: _Login, request: Request) -> str | None:
    """The tenant a request reads: the login's own; an admin may name one (``tenant=``) or see all."""
    if login.tenant is not None:
        return login.tenant
    return request.query_params.get("tenant") or None


def create_console_app(api: ConsoleApi) -> FastAPI:
    """The console's ASGI app."""
    app = FastAPI(title="stream-gateway console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.console = api

    @app.exception_handler(ConsoleError)
    async def console_error(_request: Request, exc: ConsoleError) -> JSONResponse:
        return _error_response(exc)

    @app.middleware("http")
    async def headers(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        response.headers["content-security-policy"] = _CSP
        response.headers["x-content-type-options"] = "nosniff"
        response.headers["referrer-policy"] = "no-referrer"
        response.headers.setdefault("cache-control", "no-store")
        return response

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(_STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=_STATIC), name="static")
    _signing_in(app, api)
    _sessions(app, api)
    _trajectories(app, api)
    _actions(app, api)
    return app


def _signing_in(app: FastAPI, api: ConsoleApi) -> None:
    @app.post("/api/login")
    async def login(request: Request) -> JSONResponse:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise ConsoleError(400, 'The body must be JSON: {"key": "..."}.', "invalid_request_error") from None
        key = body.get("key") if isinstance(body, dict) else None
        if not isinstance(key, str):
            raise ConsoleError(400, "`key` must be a string.", "invalid_request_error", param="key")
        token, who = api.login(key.strip())
        response = JSONResponse({"tenant": who.label, "admin": who.tenant is None, "csrf": who.csrf})
        response.set_cookie(
            COOKIE, token, max_age=int(_LOGIN_TTL_S), httponly=True, samesite="strict",
            secure=request.url.scheme == "https", path="/",
        )  # fmt: skip
        return response

    @app.post("/api/logout")
    async def logout(request: Request) -> JSONResponse:
        api.who(request, changes=True)
        api.logout(request.cookies.get(COOKIE))
        response = JSONResponse({"signed_out": True})
        response.delete_cookie(COOKIE, path="/")
        return response

    @app.get("/api/me")
    async def me(request: Request) -> dict[str, Any]:
        who = api.who(request)
        return {
            "tenant": who.label, "admin": who.tenant is None, "csrf": who.csrf,
            "flags": HEALTH_FLAGS | {"aborted-turn": "a turn of the session did not finish"}, "kinds": KINDS,
            "can_rate": api.gateway_url is not None and who.tenant is not None,
        }  # fmt: skip


def _sessions(app: FastAPI, api: ConsoleApi) -> None:
    @app.get("/api/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        who = api.who(request)
        q = request.query_params
        status = q.get("status") or None
        if status not in (None, "open", "closed"):
            raise ConsoleError(400, "`status` is `open` or `closed`.", "invalid_request_error", param="status")
        flt = SessionFilter(
            tenant=_tenant_of(who, request), agent=q.get("agent") or None, model=q.get("model") or None,
            adapter=q.get("adapter") or None, status=status, flag=q.get("flag") or None,
            since=_number(request, "since"), until=_number(request, "until"), text=q.get("q") or None,
        )  # fmt: skip
        limit = _number(request, "limit", 50, integer=True) or 50
        before_at, before_id = _number(request, "before_at"), q.get("before_id")
        before = (before_at, before_id) if before_at is not None and before_id else None
        started = time.perf_counter()
        rows = await anyio.to_thread.run_sync(lambda: api.index.sessions(flt, before=before, limit=limit))
        count = await anyio.to_thread.run_sync(api.index.count, flt)
        last = rows[-1] if len(rows) >= min(limit, PAGE_LIMIT) else None
        return {
            "sessions": rows, "count": count,
            "next": {"before_at": last["last_at"], "before_id": last["session_id"]} if last else None,
            "query_ms": round((time.perf_counter() - started) * 1000, 2),
            "caught_up": all(api.feed.caught_up.values()) if api.feed is not None else True,
        }  # fmt: skip

    @app.get("/api/facets")
    async def facets(request: Request) -> dict[str, Any]:
        who = api.who(request)
        return await anyio.to_thread.run_sync(api.index.facets, _tenant_of(who, request))

    @app.get("/api/sessions/{session_id}")
    async def session(request: Request, session_id: str) -> dict[str, Any]:
        who = api.who(request)
        tenant = _tenant_of(who, request)
        if tenant is None:  # an admin: a session id is a name within a tenant, and several may use it
            owners = await anyio.to_thread.run_sync(api.index.tenants_of, session_id)
            if len(owners) > 1:
                raise ConsoleError(
                    400,
                    f"{len(owners)} tenants have a session `{session_id}` ({', '.join(owners)}): name one with tenant=",
                    "invalid_request_error",
                    "ambiguous_session",
                    "tenant",
                )
        found = await anyio.to_thread.run_sync(api.index.session, tenant, session_id)
        if found is None:
            raise _not_found(f"session `{session_id}`")
        offset = _number(request, "offset", 0, integer=True)
        limit = _number(request, "limit", 500, integer=True)
        turns = await anyio.to_thread.run_sync(
            lambda: api.index.turns(found["tenant"], session_id, offset=offset, limit=limit)
        )
        found["turns_page"] = await anyio.to_thread.run_sync(_asked, api.tokenizers, found.get("model"), turns)
        found["turns_offset"] = offset
        return found


def _trajectories(app: FastAPI, api: ConsoleApi) -> None:
    @app.get("/api/trajectories/{trajectory_id}/tokens")
    async def tokens(request: Request, trajectory_id: str) -> dict[str, Any]:
        who = api.who(request)
        row, view = await api.view(who, trajectory_id)
        offset = _number(request, "offset", 0, integer=True)
        limit = min(_number(request, "limit", 500, integer=True) or 500, _TOKEN_PAGE)
        page = await anyio.to_thread.run_sync(view.page, offset, limit)
        data = view.data
        page["trajectory"] = {
            **row, "model": data["model"], "prompt_length": data["prompt_length"], "turns": data["turns"],
            "images": data.get("images") or [], "routes": data.get("routed_experts") is not None,
            "abort_reason": data.get("abort_reason"), "reward_source": data.get("reward_source"),
            "decoded": view.tokenizer is not None, "scores": await api.scores(row, data),
        }  # fmt: skip
        return page

    @app.get("/api/compare")
    async def compare(request: Request) -> dict[str, Any]:
        who = api.who(request)
        a, b = request.query_params.get("a", ""), request.query_params.get("b", "")
        (row_a, view_a), (row_b, view_b) = await api.view(who, a), await api.view(who, b)
        return _compare(row_a, view_a.data, row_b, view_b.data)

    @app.get("/api/loop")
    async def loop(request: Request) -> dict[str, Any]:
        who = api.who(request)
        return await anyio.to_thread.run_sync(api.index.loop, _tenant_of(who, request))


def _actions(app: FastAPI, api: ConsoleApi) -> None:
    @app.get("/api/sessions/{session_id}/live")
    async def live(request: Request, session_id: str) -> Response:
        from sse_starlette import EventSourceResponse

        who = api.who(request)
        found = await anyio.to_thread.run_sync(api.index.session, _tenant_of(who, request), session_id)
        tenant = found["tenant"] if found is not None else who.tenant
        if tenant is None or api.feed is None:
            raise _not_found(f"session `{session_id}`")
        return EventSourceResponse(_live(api, tenant, session_id, found["model"] if found else None), ping=10)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Counts only (no ids, no text), over every tenant, in Prometheus' text format."""
        counts = await anyio.to_thread.run_sync(api.index.counts)
        lines = [
            "# HELP sg_console_sessions Sessions in the console's index.", "# TYPE sg_console_sessions gauge",
            f"sg_console_sessions {counts['sessions']}",
            "# HELP sg_console_trajectories Trajectories in the console's index.",
            "# TYPE sg_console_trajectories gauge", f"sg_console_trajectories {counts['trajectories']}",
            "# HELP sg_console_trajectories_batched Trajectories that went into a batch.",
            "# TYPE sg_console_trajectories_batched gauge", f"sg_console_trajectories_batched {counts['batched']}",
            "# HELP sg_console_trajectories_health Trajectories carrying a record-health flag.",
            "# TYPE sg_console_trajectories_health gauge",
            *(f'sg_console_trajectories_health{{flag="{f}"}} {n}' for f, n in sorted(counts["health"].items())),
            "# HELP sg_console_trajectories_end_reason Trajectories by why they end.",
            "# TYPE sg_console_trajectories_end_reason gauge",
            *(f'sg_console_trajectories_end_reason{{reason="{r}"}} {n}'
              for r, n in sorted(counts["end_reasons"].items())),
            "# HELP sg_console_trajectories_dropped Trajectories the batcher left out, by reason.",
            "# TYPE sg_console_trajectories_dropped gauge",
            *(f'sg_console_trajectories_dropped{{reason="{r}"}} {n}' for r, n in sorted(counts["dropped"].items())),
        ]  # fmt: skip
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/api/sessions/{session_id}/feedback")
    async def rate(request: Request, session_id: str) -> dict[str, Any]:
        who = api.who(request, changes=True)
        if who.tenant is None:
            raise ConsoleError(403, "Rate with the session's own tenant key: an admin key reads every tenant but "
                               "rates none.", "permission_error", "tenant_key_needed")  # fmt: skip
        if api.gateway_url is None:
            raise ConsoleError(503, "This console has no gateway to send ratings to (--gateway-url).", "server_error",
                               "no_gateway")  # fmt: skip
        try:
            rating = RatingBody.model_validate_json(await request.body())
        except ValueError as exc:
            raise ConsoleError(400, f"A rating is {{score, note?, turn_id?}}: {exc}", "invalid_request_error") from None
        if await anyio.to_thread.run_sync(api.index.session, who.tenant, session_id) is None:
            raise _not_found(f"session `{session_id}`")
        try:
            return await send_rating(api.gateway_url, who.key, session_id, rating, who.label)
        except RatingError as exc:
            raise ConsoleError(exc.status, str(exc), "invalid_request_error", exc.code) from exc

    @app.post("/api/sessions/{session_id}/forget")
    async def forget(request: Request, session_id: str) -> dict[str, Any]:
        who = api.who(request, changes=True)
        if who.tenant is not None:
            raise ConsoleError(403, "Only an admin key may forget a session.", "permission_error", "admin_only")
        tenant = request.query_params.get("tenant") or None
        found = await anyio.to_thread.run_sync(api.index.session, tenant, session_id)
        if found is None:
            raise _not_found(f"session `{session_id}`")
        if api.feed is None:
            raise ConsoleError(503, "The console is not connected to NATS.", "server_error", "nats_unavailable")
        from stream_stack.erasure import ErasureTarget
        from stream_stack.erasure import forget as erase

        target = ErasureTarget(subject_token(found["tenant"]), session_id, batch_dirs=api.batch_dirs)
        receipt = await erase(api.feed.nc, target)
        await anyio.to_thread.run_sync(api.index.forget, found["tenant"], session_id)
        return {"receipt": receipt.to_json()}


async def _live(api: ConsoleApi, tenant: str, session_id: str, model: str | None) -> AsyncIterator[dict[str, str]]:
    """A session's turns as they stream: ``delta`` frames with decoded tokens, ``event`` frames for
    turns starting and ending (the page then reloads the session)."""
    assert api.feed is not None
    tokenizer = api.tokenizers.get(model) if model else None
    async with api.feed.live(tenant, session_id) as receive:
        yield {"event": "ready", "data": "{}"}
        async for kind, payload in receive:
            try:
                event = decode_event(payload)
            except ValueError:  # not an event this version reads (pydantic's and orjson's errors are ValueErrors)
                continue
            if kind == "delta":
                ids = getattr(event, "token_ids", [])
                texts = [tokenizer.decode([t]) if tokenizer is not None else f"⟨{t}⟩" for t in ids]
                frame = {"turn_id": event.turn_id, "offset": event.offset, "ids": ids, "texts": texts,  # type: ignore[attr-defined]
                         "logprobs": event.logprobs}  # type: ignore[attr-defined]  # fmt: skip
                yield {"event": "delta", "data": orjson.dumps(frame).decode()}
            else:
                yield {"event": "event", "data": orjson.dumps({"kind": event.kind,
                       "turn_id": getattr(event, "turn_id", None)}).decode()}  # fmt: skip


def _compare(row_a: dict[str, Any], a: dict[str, Any], row_b: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two chains from the last turn they share: shared turns and tokens, and the sampled tokens in
    both loss masks (none under the assembler's default train-once; with ``--shared-turns every``
    a shared sampled token is in the loss of every chain that holds it)."""
    shared_turns = 0
    for x, y in zip(row_a["turn_ids"], row_b["turn_ids"], strict=False):
        if x != y:
            break
        shared_turns += 1
    ids_a, ids_b = a["token_ids"], b["token_ids"]
    shared = 0
    for x, y in zip(ids_a, ids_b, strict=False):
        if x != y:
            break
        shared += 1
    twice = sum(1 for i in range(shared) if a["loss_mask"][i] and b["loss_mask"][i])
    return {
        "a": row_a["trajectory_id"], "b": row_b["trajectory_id"], "shared_turns": shared_turns,
        "shared_tokens": shared, "length_a": len(ids_a), "length_b": len(ids_b),
        "shared_sampled_in_both_losses": twice,
        "batches": [row_a.get("batch_id"), row_b.get("batch_id")],
    }  # fmt: skip
