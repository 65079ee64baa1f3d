"""Who is calling: the bearer key (or Anthropic's ``x-api-key``), its tenant and limits, and
whether it may administer the gateway."""

from __future__ import annotations

from collections.abc import Collection

from fastapi import Request

from stream_gateway._errors import AuthenticationFailed, PermissionDenied
from stream_gateway.control import KeyEntry, KeyRing, Limits

__all__ = ["Authorizer", "bearer"]


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
