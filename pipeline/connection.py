"""How every component authenticates to NATS and encrypts the connection: one option group.

The gateway (publisher, shared sessions, policy and upstream followers), ``tail``,
``publish-weights``, the assembler, the batcher and the verl adapter all connect with
:func:`connect` and a :class:`NatsAuth`, so one set of options means the same thing everywhere:

* ``user`` / ``password`` or ``token`` (nats-server's ``authorization`` block); a URL's
  ``nats://user:password@host`` works too, as nats-py reads it;
* ``creds``: a credentials file (a user JWT and its NKey seed: decentralised auth with ``nsc``);
* ``nkey``: a file holding a user's NKey seed (``SU...``; the server lists its public key);
* ``tls_ca`` (the CA that signed the server's certificate; without it the system's CAs),
  ``tls_cert`` + ``tls_key`` (a client certificate, for servers that ``verify`` clients),
  ``tls_hostname`` (the name to check in the server's certificate, when the URL's host differs).
  A ``tls://`` URL, or any TLS option, makes the client require TLS.

Secrets never need to be on a command line (visible in ``ps``): the password and token also come
from ``STREAM_GATEWAY_NATS_PASSWORD`` and ``STREAM_GATEWAY_NATS_TOKEN``, and the credentials and
seed are files.

A refused connection fails at once with :class:`NatsRefused` and a message that says what was
wrong (credentials, TLS), even for components that otherwise wait for a server that is not up
yet: retrying a wrong password forever only hides the mistake. nats-py 2.16 (read for this)
reports a refusal during its first connect through the error callback, then retries; the
callback raising ends ``connect``.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import NatsRefused

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from nats.aio.client import Client

__all__ = [
    "PASSWORD_ENV",
    "TOKEN_ENV",
    "NatsAuth",
    "NatsRefused",
    "add_nats_arguments",
    "close_quietly",
    "connect",
    "nats_auth_from_args",
    "refusal",
    "split_servers",
]

PASSWORD_ENV = "STREAM_GATEWAY_NATS_PASSWORD"
_FLAG_FIELDS = ("user", "password", "token", "creds", "nkey", "tls_ca", "tls_cert", "tls_key", "tls_hostname")
TOKEN_ENV = "STREAM_GATEWAY_NATS_TOKEN"


@dataclass(frozen=True, slots=True)
class NatsAuth:
    """Credentials and TLS options for a NATS connection; empty: plain and anonymous."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: Path | None = None
    nkey: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_hostname: str | None = None

    def __post_init__(self) -> None:
        if self.password is not None and self.user is None:
            raise ValueError("a NATS password needs a user (--nats-user)")
        if self.token is not None and self.user is not None:
            raise ValueError("give a NATS user and password or a token, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a NATS client certificate needs both --nats-tls-cert and --nats-tls-key")
        if self.creds is not None and self.nkey is not None:
            raise ValueError("give a NATS credentials file or an NKey seed file, not both")
        for name in ("creds", "nkey", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"NATS {name.replace('_', ' ')} file {path} does not exist")

    def __repr__(self) -> str:  # never print a secret
        shown = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        for secret in ("password", "token"):
            if secret in shown:
                shown[secret] = "***"
        return f"NatsAuth({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_options(cls, options: Any) -> NatsAuth:
        """From a mapping (a config file's, an OmegaConf node) with this class's field names.

        A password (with a user) or a token (without one) not in it comes from
        ``STREAM_GATEWAY_NATS_PASSWORD`` / ``STREAM_GATEWAY_NATS_TOKEN``, so that neither config
        files nor command lines need hold secrets. The one place, outside the gateway's Settings,
        that reads them.
        """
        values = {str(k): v for k, v in dict(options or {}).items() if v is not None}
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ValueError(f"unknown NATS auth settings {unknown}; known: {sorted(known)}")
        if "user" in values and "password" not in values and os.environ.get(PASSWORD_ENV):
            values["password"] = os.environ[PASSWORD_ENV]
        if "token" not in values and "user" not in values and os.environ.get(TOKEN_ENV):
            values["token"] = os.environ[TOKEN_ENV]
        files = ("creds", "nkey", "tls_ca", "tls_cert", "tls_key")
        converted: dict[str, Any] = {k: Path(str(v)).expanduser() if k in files else str(v) for k, v in values.items()}
        return cls(**converted)

    @property
    def tls(self) -> bool:
        return any(p is not None for p in (self.tls_ca, self.tls_cert, self.tls_hostname))

    def ssl_context(self) -> ssl.SSLContext:
        """The client's TLS context: the given CA (else the system's) and client certificate."""
        context = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
        if self.tls_cert is not None and self.tls_key is not None:
            context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (nats-py 2.16)."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options["user"] = self.user
            options["password"] = self.password or ""
        if self.token is not None:
            options["token"] = self.token
        if self.creds is not None:
            options["user_credentials"] = str(self.creds)
        if self.nkey is not None:
            options["nkeys_seed"] = str(self.nkey)
        if self.tls:
            options["tls"] = self.ssl_context()
            if self.tls_hostname is not None:
                options["tls_hostname"] = self.tls_hostname
        return options


def split_servers(urls: str) -> tuple[str, ...]:
    """``"nats://a:4222, nats://b:4222"`` → the URLs, stripped."""
    return tuple(u.strip() for u in urls.split(",") if u.strip())


def refusal(exc: BaseException, auth: NatsAuth) -> str | None:
    """What the server refused, in words, when ``exc`` is a refusal (not a server that is away)."""
    text = str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = "" if auth.tls_ca else " (is its CA given with --nats-tls-ca?)"
        return f"the server's TLS certificate was not accepted: {exc.verify_message}{hint}"
    if isinstance(exc, ssl.SSLError):
        return f"the TLS handshake failed ({exc.reason or text}); check --nats-tls-cert/--nats-tls-key"
    import nats.errors

    if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text.lower():
        given = _what_was_given(auth)
        return f"the server refused this client's credentials (Authorization Violation; {given})"
    if "authentication expired" in text.lower() or "user authentication revoked" in text.lower():
        return f"the server refused this client's credentials ({text.strip()})"
    if isinstance(exc, nats.errors.SecureConnRequiredError) or "secure connection - tls required" in text.lower():
        return "the server requires TLS: use a tls:// URL or give --nats-tls-ca"
    if isinstance(exc, nats.errors.SecureConnWantedError):
        return "the server does not offer TLS, but TLS options were given"
    if isinstance(exc, nats.errors.InvalidUserCredentialsError):
        return f"the credentials file is not valid ({text})"
    return None


def _what_was_given(auth: NatsAuth) -> str:
    if auth.creds is not None:
        return f"credentials file {auth.creds}"
    if auth.nkey is not None:
        return f"NKey seed file {auth.nkey}"
    if auth.token is not None:
        return "a token"
    if auth.user is not None:
        return f"user {auth.user!r} with a password"
    return "no credentials were given: --nats-user/--nats-password, --nats-token, --nats-creds or --nats-nkey"


async def connect(
    servers: str | tuple[str, ...] | list[str],
    auth: NatsAuth | None = None,
    *,
    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
    **options: Any,
) -> Client:
    """``nats.connect(servers, **options)`` with ``auth``'s options; a refusal raises :class:`NatsRefused`.

    ``options`` are nats-py's (``name``, ``connect_timeout``, ``max_reconnect_attempts``, the
    callbacks ...). A server that is away keeps nats-py's behaviour (retries as ``options`` say);
    a server that refuses this client ends the first connect at once. After the first connect a
    refusal (a revoked user, say) is handed to ``error_cb`` like any other error.
    """
    from nats.aio.client import Client

    auth = auth or NatsAuth()
    listed = [servers] if isinstance(servers, str) else list(servers)
    client = Client()
    connected = False

    async def on_error(exc: Exception) -> None:
        if not connected and (reason := refusal(exc, auth)) is not None:
            raise NatsRefused(f"NATS at {', '.join(listed)}: {reason}") from exc
        if error_cb is not None:
            await error_cb(exc)

    for name in ("disconnected_cb", "closed_cb"):  # a refused client was never connected
        if (callback := options.get(name)) is not None:
            options[name] = _once_connected(callback, lambda: connected)
    try:
        await client.connect(listed, error_cb=on_error, **auth.connect_options(), **options)
    except NatsRefused:
        await _discard(client)
        raise
    except Exception as exc:  # a refusal when reconnecting is off does not reach the callback
        if (reason := refusal(exc, auth)) is not None:
            await _discard(client)
            raise NatsRefused(f"NATS at {', '.join(listed)}: {reason}") from exc
        raise
    connected = True
    return client


def _once_connected(callback: Callable[[], Awaitable[None]], connected: Callable[[], bool]) -> Any:
    async def call() -> None:
        if connected():
            await callback()

    return call


async def close_quietly(client: Client, timeout_s: float = 2.0) -> None:
    """Close ``client`` in a shielded scope of ``timeout_s``: cancellation cannot skip it, and a
    server gone away (or a TLS transport that never reports closed) cannot hold shutdown up."""
    import anyio

    if not client.is_closed:
        with anyio.move_on_after(timeout_s, shield=True):
            await client.close()


async def _discard(client: Client) -> None:
    """Close a client whose first connect was refused.

    After a failed certificate check nats-py 2.16's ``close`` closes the socket, then waits
    forever for the TLS transport to report it closed: that wait is cut short.
    """
    await close_quietly(client, 1.0)


def add_nats_arguments(parser: argparse.ArgumentParser, *, url_default: str | None = "nats://127.0.0.1:4222") -> None:
    """The NATS options every command shares: server URLs, credentials, TLS."""
    group = parser.add_argument_group("NATS connection")
    url_help = "NATS server(s), comma-separated" + (f" (default {url_default})" if url_default else "")
    group.add_argument("--nats-url", default=url_default, help=url_help)
    group.add_argument("--nats-user", help="NATS user (with --nats-password)")
    group.add_argument("--nats-password", help=f"NATS password (better: ${PASSWORD_ENV})")
    group.add_argument("--nats-token", help=f"NATS token (better: ${TOKEN_ENV})")
    group.add_argument("--nats-creds", help="NATS credentials file (user JWT + NKey seed)")
    group.add_argument("--nats-nkey", help="file holding the user's NKey seed (SU...)")
    group.add_argument("--nats-tls-ca", help="CA certificate(s) that signed the server's (PEM)")
    group.add_argument("--nats-tls-cert", help="client certificate (PEM), for servers that verify clients")
    group.add_argument("--nats-tls-key", help="the client certificate's private key (PEM)")
    group.add_argument("--nats-tls-hostname", help="name to expect in the server's certificate")


def nats_auth_from_args(args: argparse.Namespace) -> NatsAuth:
    """The :class:`NatsAuth` of :func:`add_nats_arguments`'s flags (and the secrets' variables)."""
    return NatsAuth.from_options({name: getattr(args, f"nats_{name}") for name in _FLAG_FIELDS})
