"""API keys, tenants and per-tenant limits.

Keys come from ``--api-key`` (each its own tenant, named by the key) and from ``--api-key-file``
(``key tenant [limit=value ...] [adapter=NAME] [capture=on|off]`` per line; several keys may
name one tenant; reloaded on SIGHUP). ``adapter=NAME`` binds the tenant to a LoRA adapter
(``--lora``): every request of that key is served by it, whatever model the client names, and no
other tenant may name it (docs/adapters.md). ``capture=off``: the key's users did not consent,
nothing of their requests is captured; ``capture=on``: they must be, and a request's
``X-Capture: off`` is refused; unset, each request decides (docs/data-rights.md).
With neither, any key is accepted and is its own tenant (a request without one is ``anonymous``).
A tenant name is what sessions belong to; events carry only its digest (``tenant_id``), and no key
is ever logged.

Limits are per tenant, from the key file's line or else the gateway's defaults; any may be unset:

* ``concurrency``: requests in flight (a streamed one until its last frame is written);
* ``rpm``: requests a minute, ``tpm``: prompt + completion tokens a minute, as token buckets
  (a burst of a minute's worth, refilled continuously); tokens are debited as they are known, so
  a tenant may go into debt by one request and then waits until the bucket is positive again;
* ``sessions``: open sessions this replica holds for the tenant.

Over a limit: 429 ``rate_limit_exceeded`` with ``Retry-After`` (whole seconds), which the OpenAI
SDKs (Python and Node: pi, OpenClaw) honour and retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from stream_gateway._errors import RateLimited

__all__ = ["KeyEntry", "KeyRing", "Limits", "RateLimited", "RateLimiter", "read_key_file"]

log = logging.getLogger(__name__)

_LIMIT_NAMES = ("concurrency", "rpm", "tpm", "sessions")


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits; ``None``: unlimited."""

    concurrency: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    sessions: int | None = None

    def over(self, defaults: Limits) -> Limits:
        """These limits, with ``defaults`` where unset."""
        return Limits(
            *(getattr(self, n) if getattr(self, n) is not None else getattr(defaults, n) for n in _LIMIT_NAMES)
        )


@dataclass(frozen=True, slots=True)
class KeyEntry:
    tenant: str
    limits: Limits
    adapter: str | None = None  # the LoRA adapter that serves every request of this key
    capture: bool | None = None  # False: never captured; True: always (X-Capture: off refused); None: per request


def read_key_file(path: Path) -> dict[str, KeyEntry]:
    """``key tenant [limit=value ...] [adapter=NAME] [capture=on|off]`` per line (``#`` comments);
    ``ValueError`` naming the line (also for one tenant bound to two adapters, or one adapter to
    two tenants, or one tenant's keys disagreeing on capture)."""
    keys: dict[str, KeyEntry] = {}
    bound: dict[str, str] = {}  # adapter -> tenant
    captures: dict[str, bool] = {}  # tenant -> its capture=, where a line said it
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2:
            raise ValueError(
                f"{path}:{number}: expected `key tenant [limit=value ...] [adapter=NAME] [capture=on|off]`"
            )
        key, tenant, *rest = parts
        values: dict[str, int] = {}
        adapter: str | None = None
        capture: bool | None = None
        for item in rest:
            name, _, value = item.partition("=")
            if name == "capture":
                if value not in ("on", "off"):
                    raise ValueError(f"{path}:{number}: capture= is on or off, not {value!r}")
                capture = value == "on"
                agreed = captures.setdefault(tenant, capture)
                if agreed != capture:
                    raise ValueError(f"{path}:{number}: another key of tenant {tenant!r} says capture={_onoff(agreed)}")
                continue
            if name == "adapter":
                if not value:
                    raise ValueError(f"{path}:{number}: adapter= needs a name")
                owner = bound.setdefault(value, tenant)
                if owner != tenant:
                    raise ValueError(f"{path}:{number}: adapter {value!r} is already bound to tenant {owner!r}")
                adapter = value
                continue
            if name not in _LIMIT_NAMES or not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"{path}:{number}: bad limit {item!r}; limits are {', '.join(_LIMIT_NAMES)}, each =N with N >= 1"
                )
            values[name] = int(value)
        if key in keys:
            raise ValueError(f"{path}:{number}: a key appears twice")
        keys[key] = KeyEntry(tenant, Limits(**values), adapter, capture)
    for key, entry in keys.items():  # every key of a bound tenant is bound, to one adapter
        owned = {a for a, t in bound.items() if t == entry.tenant}
        if len(owned) > 1:
            raise ValueError(f"{path}: tenant {entry.tenant!r} is bound to several adapters: {sorted(owned)}")
        adapter = entry.adapter if entry.adapter is not None or not owned else next(iter(owned))
        # A tenant's capture= holds for all its keys (a line without one takes another's).
        keys[key] = KeyEntry(entry.tenant, entry.limits, adapter, captures.get(entry.tenant))
    return keys


def _onoff(value: bool) -> str:
    return "on" if value else "off"


class KeyRing:
    """Which keys are accepted and whose tenant each is."""

    def __init__(self, api_keys: Iterable[str], key_file: Path | None, defaults: Limits) -> None:
        self._static = {key: KeyEntry(key, defaults) for key in api_keys}
        self._file = key_file
        self._defaults = defaults
        self._keys = dict(self._static)
        self._owners: dict[str, str] = {}
        if key_file is not None:
            self._load()

    @property
    def open(self) -> bool:
        """No keys configured: any key is accepted (and is its own tenant)."""
        return not self._keys and self._file is None

    def adapter_owner(self, adapter: str) -> str | None:
        """The tenant bound to ``adapter`` (``None``: any tenant may name it)."""
        return self._owners.get(adapter)

    def entry(self, key: str) -> KeyEntry | None:
        """The key's tenant and limits; ``None`` for a key that is not accepted."""
        found = self._keys.get(key)
        if found is not None or not self.open:
            return found
        return KeyEntry(key or "anonymous", self._defaults)

    def reload(self) -> None:
        """Read the key file again (SIGHUP); a bad file keeps the keys in use, and says why."""
        if self._file is None:
            return
        try:
            self._load()
        except (OSError, ValueError) as exc:
            log.error("key file not reloaded, the previous keys stay in use: %s", exc)
            return
        log.info("key file %s reloaded: %d keys", self._file, len(self._keys) - len(self._static))

    def _load(self) -> None:
        assert self._file is not None
        entries = read_key_file(self._file)
        self._keys = {
            **self._static,
            **{k: KeyEntry(e.tenant, e.limits.over(self._defaults), e.adapter, e.capture) for k, e in entries.items()},
        }
        self._owners = {e.adapter: e.tenant for e in entries.values() if e.adapter is not None}


@dataclass(slots=True)
class _Bucket:
    """A token bucket of ``capacity`` refilled at ``capacity`` a minute; it may go into debt."""

    capacity: float
    level: float
    stamp: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now

    def wait_s(self, need: float) -> float:
        """Seconds until the bucket holds ``need``."""
        return max(0.0, (need - self.level) * 60.0 / self.capacity)


@dataclass(slots=True)
class _Usage:
    limits: Limits = field(default_factory=Limits)  # as of the tenant's last request
    in_flight: int = 0
    requests: _Bucket | None = None
    tokens: _Bucket | None = None


class RateLimiter:
    """Admits requests per tenant; all on the event loop, no locks."""

    def __init__(self, count_sessions: Callable[[str], int]) -> None:
        self._usage: dict[str, _Usage] = {}
        self._count_sessions = count_sessions

    def admit(self, tenant: str, limits: Limits) -> Callable[[], None]:
        """Take a request slot, or raise :class:`RateLimited`; returns the idempotent release."""
        if limits == _NO_LIMITS:
            if (known := self._usage.get(tenant)) is not None:
                known.limits = limits  # a reload lifted them: spend() and sessions stop counting
            return _nothing
        usage = self._usage.setdefault(tenant, _Usage())
        usage.limits = limits
        now = time.monotonic()
        if limits.concurrency is not None and usage.in_flight >= limits.concurrency:
            raise RateLimited(
                f"Rate limit reached: {limits.concurrency} requests in flight for this key. Retry when one ends.", 1.0
            )
        if limits.rpm is not None:
            bucket = usage.requests = _resized(usage.requests, limits.rpm)
            bucket.refill(now)
            if bucket.level < 1:
                raise RateLimited(
                    f"Rate limit reached: {limits.rpm} requests per minute for this key.", bucket.wait_s(1)
                )
        if limits.tpm is not None:
            bucket = usage.tokens = _resized(usage.tokens, limits.tpm)
            bucket.refill(now)
            if bucket.level <= 0:
                raise RateLimited(
                    f"Rate limit reached: {limits.tpm} tokens per minute for this key.", bucket.wait_s(1), kind="tokens"
                )
        if limits.rpm is not None and usage.requests is not None:
            usage.requests.level -= 1
        usage.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                usage.in_flight -= 1

        return release

    def spend(self, tenant: str, tokens: int) -> None:
        """Debit ``tokens`` (prompt or completion) from the tenant's tokens-per-minute bucket."""
        usage = self._usage.get(tenant)
        limits = usage.limits if usage is not None else _NO_LIMITS
        if usage is None or limits.tpm is None or not tokens:
            return
        bucket = usage.tokens = _resized(usage.tokens, limits.tpm)
        bucket.refill(time.monotonic())
        bucket.level -= tokens

    def check_new_session(self, tenant: str) -> None:
        """Raise if the tenant (admitted by :meth:`admit`) may not open another session here."""
        usage = self._usage.get(tenant)
        limits = usage.limits if usage is not None else _NO_LIMITS
        if limits.sessions is not None and self._count_sessions(tenant) >= limits.sessions:
            raise RateLimited(
                f"Limit reached: {limits.sessions} open sessions for this key. Close one "
                "(POST /sessions/{id}/close) or wait for an idle one to close.",
                60.0,
            )


_NO_LIMITS = Limits()


def _nothing() -> None:
    return None


def _resized(bucket: _Bucket | None, capacity: int) -> _Bucket:
    if bucket is None:
        return _Bucket(float(capacity), float(capacity))
    if bucket.capacity != capacity:  # the key file was reloaded with another limit
        bucket.capacity = float(capacity)
        bucket.level = min(bucket.level, bucket.capacity)
    return bucket
