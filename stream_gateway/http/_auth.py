"""Who is calling: the bearer key (or Anthropic's ``x-api-key``), its tenant and limits, whether
it may administer the gateway, and whether its request may be captured."""

from __future__ import annotations

from collections.abc import Collection

from fastapi import Request

from stream_gateway._errors import AuthenticationFailed, InvalidRequest, PermissionDenied
from stream_gateway.control import KeyEntry, KeyRing, Limits

__all__ = ["CAPTURE_HEADER", "WARNING_HEADER", "Authorizer", "bearer", "captured"]

CAPTURE_HEADER = "x-capture"
WARNING_HEADER = "x-stream-gateway-warning"  # what a client should know (the template dropped its tools)


def captured(request: Request, entry: KeyEntry) -> tuple[bool, str | None]:
    """Whether the request may be captured, and if not, why (``tenant`` or ``request``).

    ``X-Capture: off`` (or ``on``) asks; the tenant's ``capture=`` in the key file decides first:
    ``off`` never captures (a request's ``on`` does not override its users' refusal), ``on``
    refuses a request's ``off`` (403: the operator requires capture for that key).
    """
    asked = request.headers.get(CAPTURE_HEADER)
    wanted: bool | None = None
    if asked is not None:
        value = asked.strip().lower()
        if value not in ("on", "off"):
            raise InvalidRequest(f"{CAPTURE_HEADER}: expected `on` or `off`, got {asked!r}", param=CAPTURE_HEADER)
        wanted = value == "on"
    if entry.capture is False:
        return False, "tenant"
    if wanted is False:
        if entry.capture is True:
            raise PermissionDenied(
                f"This key's requests are captured (capture=on for its tenant); `{CAPTURE_HEADER}: off` is not allowed."
            )
        return False, "request"
    return True, None


def bearer(request: Request) -> str:
    """The request's API key: ``Authorization: Bearer``, else Anthropic's ``x-api-key``."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer":
        return key.strip()
    return request.headers.get("x-api-key", "").strip()


class Authorizer:
    """Accepts or refuses requests by their key (see :mod:`stream_gateway.control`'s tenants)."""

    def __init__(self, keyring: KeyRing, admin_keys: Collection[str], defaults: Limits) -> None:
        self.keyring = keyring
        self._admin_keys = admin_keys
        self._defaults = defaults

    def entry(self, request: Request) -> KeyEntry:
        """The request's tenant and limits; 401 for a key not accepted."""
        key = bearer(request)
        entry = self.keyring.entry(key)
        if entry is None:
            if key not in self._admin_keys:  # an admin key is also accepted where others are
                raise AuthenticationFailed("Incorrect API key provided.")
            entry = KeyEntry(key, self._defaults)
        return entry

    def tenant(self, request: Request) -> str:
        """The request's tenant: its key file name, or else its bearer key (``anonymous`` without one)."""
        return self.entry(request).tenant

    def admin(self, request: Request, action: str) -> None:
        """Refuse (403) a key that may not do ``action`` (401 for one not accepted at all)."""
        self.tenant(request)
        key = bearer(request)
        if not self._admin_keys:
            raise PermissionDenied(f"{action.capitalize()} is disabled; start the gateway with --admin-api-key.")
        if key not in self._admin_keys:
            raise PermissionDenied(f"This key may not do {action}.")
