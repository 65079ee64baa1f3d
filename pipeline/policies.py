"""Policies over NATS: a trainer publishes weights once, every gateway replica applies them.

Publishing (:func:`publish_policy`, ``stream-gateway publish-weights``):

1. every ``*.safetensors`` file of a directory becomes the object ``v<version>/<file name>`` of
   the object store bucket ``sg_policies``, streamed from disk in chunks under the server's max
   payload, its SHA-256 computed as it is read;
2. only then is ``policy.updated`` published (acked, ``Nats-Msg-Id`` ``policy-<version>``) on
   ``<prefix>.events._._.policy.updated``, naming the objects and their digests: a gateway never
   hears of a policy whose files are not all stored;
3. the objects of every version older than the ``keep_full`` newest full versions are deleted
   (each object's description says ``full`` or ``partial``, so the bucket alone tells them apart).

LoRA adapters (``publish_policy(..., adapter=NAME)``, ``publish-weights --adapter NAME``) travel the
same way, with their own versions: the two files of a PEFT adapter directory
(``adapter_config.json``, ``adapter_model.safetensors``) become ``adapters/<name>/v<version>/<file>``,
and ``policy.updated`` (``adapter: NAME``, ``Nats-Msg-Id`` ``adapter-<name>-<version>``) goes to
``<prefix>.events._.adapters.policy.updated``: the base's subject keeps only the base's versions,
which the verl publisher and the batcher read as the newest policy. The publisher refuses a
version not above the newest published for that adapter (:class:`StalePolicyVersion`, before
uploading anything); the ``keep_full`` newest versions of each adapter are kept.

Following (:func:`download_policy`, used by the gateway): each object is written to a local
directory and its SHA-256 compared with the event's; a mismatch, a missing or truncated object is
a :class:`PolicyDownloadError` with a ``reason`` that ``policy.rejected`` reports.

Deliberate choices:

* The event is the single source of truth, kept on the events stream like every durable event,
  so a gateway that starts later replays ``policy.updated`` events to find the newest full
  version and the partial ones after it (:func:`policy_history`).
* Objects are downloaded to disk, not into memory: nats-py's ``ObjectStore.get`` without
  ``writeinto`` grows one ``bytes`` by concatenation, quadratic in the number of chunks (read in
  nats-py 2.16.0, ``nats/js/object_store.py``).
* Digests are ours (hex SHA-256 in the event) as well as nats-py's own per-object check: an object
  replaced under the same name after the event was published is caught by ours.
* The events stream is the gateways': publishing makes sure it exists, but with the default
  :class:`~pipeline.streams.StreamSpec` (``replicas`` and limits ``None``) an existing stream keeps
  its replicas and limits, and the bucket its replicas; a ``spec.replicas`` given
  (``publish-weights --stream-replicas``) is applied to both.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from .durable import PAYLOAD_HEADROOM
from .errors import PolicyDownloadError, StalePolicyVersion
from .events import PolicyObject, PolicyUpdated, decode_event, encode_event, new_event_id
from .streams import StreamSpec, ensure_bucket, ensure_stream

if TYPE_CHECKING:
    import torch
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.object_store import ObjectStore

__all__ = [
    "ADAPTER_FILES",
    "POLICY_BUCKET",
    "PolicyDownloadError",
    "StalePolicyVersion",
    "adapter_subject",
    "announce_policy",
    "download_policy",
    "mark_refused",
    "newest_adapter_version",
    "policy_history",
    "policy_subject",
    "policy_subjects",
    "publish_policy",
    "publish_tensors",
    "refusal_mark",
]

POLICY_BUCKET = "sg_policies"
_CHUNK_BYTES = 128 * 1024
_VERSION_PREFIX = re.compile(r"^v(\d+)/")
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # as PolicyUpdated.adapter and POST /policy/weights
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT adapter directory, as published

log = logging.getLogger(__name__)

# On the first object of a policy version that a gateway refused for good (a corrupt upload, a
# checkpoint the engine's checks reject): the reason, the replica that refused it first, and what
# was wrong. Values are lists, as NATS headers are in every client's object-store metadata.
REFUSED_HEADERS = ("Sg-Refused", "Sg-Refused-By", "Sg-Refused-Detail")


def policy_subject(prefix: str = "sg") -> str:
    """The subject the base model's ``policy.updated`` events are published on."""
    return f"{prefix}.events._._.policy.updated"


def adapter_subject(prefix: str = "sg") -> str:
    """The subject LoRA adapters' ``policy.updated`` events are published on (every adapter's)."""
    return f"{prefix}.events._.adapters.policy.updated"


def policy_subjects(prefix: str = "sg") -> str:
    """A filter matching both: what a gateway follows."""
    return f"{prefix}.events._.*.policy.updated"


def _object_name(version: int, file_name: str, adapter: str | None = None) -> str:
    name = f"v{version:010d}/{file_name}"
    return name if adapter is None else f"adapters/{adapter}/{name}"


async def publish_policy(
    nc: Client,
    directory: str | Path,
    policy_version: int,
    *,
    spec: StreamSpec | None = None,
    bucket: str = POLICY_BUCKET,
    full: bool = True,
    model: str = "",
    weights: str | None = None,
    previous_version: int | None = None,
    keep_full: int = 2,
    progress: Callable[[str], None] | None = None,
    adapter: str | None = None,
) -> PolicyUpdated:
    """Upload the ``*.safetensors`` files of ``directory`` and announce them as ``policy_version``.

    ``full``: the files hold the whole state dict; otherwise only the tensors that changed since
    the previous version. Returns the published event. Gateways refuse a version that is not
    above the one they serve (``policy.rejected``, reason ``not_newer``).

    ``adapter``: ``directory`` is a PEFT adapter directory, published as version ``policy_version``
    of that LoRA adapter; raises :class:`StalePolicyVersion` (nothing uploaded) if the stream
    already has that adapter at this version or above.
    """
    if policy_version < 1:
        raise ValueError("policy_version must be >= 1 (0 is the weights a gateway starts with)")
    if keep_full < 1:
        raise ValueError("keep_full must be >= 1")
    if adapter is not None:
        files = await anyio.to_thread.run_sync(_adapter_files, Path(directory), adapter, full)
    else:
        files = sorted(await anyio.to_thread.run_sync(lambda: list(Path(directory).glob("*.safetensors"))))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    spec = spec or StreamSpec()
    js = nc.jetstream()
    await ensure_stream(js, spec)
    if adapter is not None:
        newest = await newest_adapter_version(js, adapter, spec)
        if policy_version <= newest:
            raise StalePolicyVersion(
                f"adapter {adapter}: version {policy_version} is not above {newest}, the newest published", newest
            )
        previous_version = previous_version if previous_version is not None else (newest or None)
    store = await ensure_bucket(js, bucket, replicas=spec.replicas)
    chunk = min(_CHUNK_BYTES, nc.max_payload - PAYLOAD_HEADROOM)
    objects = []
    for file in files:
        started = time.monotonic()
        name = _object_name(policy_version, file.name, adapter)
        digest = await _put_file(store, name, file, chunk, "full" if full else "partial")
        size = file.stat().st_size
        objects.append(PolicyObject(name=name, sha256=digest, size=size))
        if progress is not None:
            seconds = time.monotonic() - started
            progress(f"uploaded {file.name} ({size / 2**20:.1f} MiB) as {bucket}/{name} in {seconds:.1f} s")
    event = _policy_event(
        model, policy_version, previous_version, weights or str(directory), bucket, objects, full, adapter
    )
    await _announce(js, spec, event)
    if adapter is not None:
        await _prune(store, policy_version, keep_full, re.compile(rf"^adapters/{re.escape(adapter)}/v(\d+)/"))
    elif full:
        await _prune(store, policy_version, keep_full)
    return event


def _adapter_files(directory: Path, adapter: str, full: bool) -> list[Path]:
    """The files of the PEFT adapter directory ``directory``; ``ValueError``/``FileNotFoundError`` if it is not one."""
    import json

    if not _ADAPTER_NAME.fullmatch(adapter):
        raise ValueError(f"adapter name {adapter!r}: 1-128 of A-Z a-z 0-9 _ . -")
    if not full:
        raise ValueError("an adapter version is always whole (its two files): no partial adapter versions")
    files = [directory / name for name in ADAPTER_FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        pickled = (
            " (only the pickled adapter_model.bin: convert it with PEFT)"
            if (directory / "adapter_model.bin").exists()
            else ""
        )
        raise FileNotFoundError(f"no {' or '.join(missing)} in {directory}: not a PEFT adapter directory{pickled}")
    try:
        config = json.loads(files[0].read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{files[0]}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{files[0]} holds {type(config).__name__}, not an object")
    return files


async def newest_adapter_version(js: JetStreamContext, adapter: str, spec: StreamSpec | None = None) -> int:
    """The newest version of ``adapter`` published on the stream; 0 if none."""
    history = await policy_history(js, spec, adapters=True)
    return max((e.policy_version for e in history if e.adapter == adapter), default=0)


async def announce_policy(
    nc: Client,
    policy_version: int,
    *,
    spec: StreamSpec | None = None,
    model: str = "",
    weights: str | None = None,
    previous_version: int | None = None,
) -> PolicyUpdated:
    """Announce that inference servers now serve ``policy_version``, uploading nothing.

    For gateways in front of remote servers (``--engine vllm-http|sglang-http``) whose weights the
    trainer updates itself: they label tokens with the announced version from then on. Gateways
    with in-process weights refuse it (``policy.rejected``, ``download_failed``: no objects).
    """
    if policy_version < 1:
        raise ValueError("policy_version must be >= 1 (0 is the weights a gateway starts with)")
    spec = spec or StreamSpec()
    js = nc.jetstream()
    await ensure_stream(js, spec)
    event = _policy_event(model, policy_version, previous_version, weights, None, [], True)
    await _announce(js, spec, event)
    return event


def _policy_event(
    model: str,
    policy_version: int,
    previous_version: int | None,
    weights: str | None,
    bucket: str | None,
    objects: list[PolicyObject],
    full: bool,
    adapter: str | None = None,
) -> PolicyUpdated:
    return PolicyUpdated.model_validate(
        {
            "event_id": new_event_id(),
            "time": time.time(),
            "tenant": "_",
            "session_id": None,
            "seq": 0,
            "model": model,
            "policy_version": policy_version,
            "previous_version": previous_version,
            "weights": weights,
            "bucket": bucket,
            "objects": objects,
            "full": full,
            "adapter": adapter,
        }
    )


async def _announce(js: JetStreamContext, spec: StreamSpec, event: PolicyUpdated) -> None:
    """Publish ``event`` (deduplicated by version: publishing the same version twice is one event)."""
    if event.adapter is not None:
        headers = {"Nats-Msg-Id": f"adapter-{event.adapter}-{event.policy_version}"}
        subject = adapter_subject(spec.prefix)
    else:
        headers = {"Nats-Msg-Id": f"policy-{event.policy_version}"}
        subject = policy_subject(spec.prefix)
    await js.publish(subject, encode_event(event), headers=headers, timeout=10)


async def publish_tensors(
    nc: Client, tensors: Mapping[str, torch.Tensor], policy_version: int, **options: object
) -> PolicyUpdated:
    """:func:`publish_policy` for in-memory tensors (a trainer's state dict), via a temporary file."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="sg-policy-") as directory:
        contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        await anyio.to_thread.run_sync(save_file, contiguous, str(Path(directory) / "model.safetensors"))
        return await publish_policy(nc, directory, policy_version, **options)  # type: ignore[arg-type]


async def _put_file(store: ObjectStore, name: str, file: Path, chunk: int, kind: str) -> str:
    """Stream ``file`` into the object ``name``; its hex SHA-256."""
    from nats.js.api import ObjectMeta, ObjectMetaOptions

    digest = hashlib.sha256()

    class _Hashing:
        """A reader nats-py accepts (``readinto``) that hashes what it reads."""

        def __init__(self, raw: object) -> None:
            self._raw = raw

        def readinto(self, buffer: bytearray) -> int:
            n: int = self._raw.readinto(buffer)  # type: ignore[attr-defined]
            digest.update(memoryview(buffer)[:n])
            return n

    with file.open("rb") as raw:
        meta = ObjectMeta(name=name, description=kind, options=ObjectMetaOptions(max_chunk_size=chunk))
        await store.put(name, _Hashing(raw), meta=meta)  # type: ignore[arg-type]
    return digest.hexdigest()


async def _prune(
    store: ObjectStore, newest_full: int, keep_full: int, versioned: re.Pattern[str] = _VERSION_PREFIX
) -> None:
    """Delete the objects of every version older than the ``keep_full`` newest full ones up to
    ``newest_full`` (just published): what a replica catching up needs is the newest full version
    and the partial ones after it. ``versioned``: the names of one line of versions (the base's,
    or one adapter's), the version its first group."""
    from nats.js.errors import NotFoundError

    try:
        infos = await store.list()
    except NotFoundError:  # an empty bucket
        return
    versions: dict[int, list[str]] = {}
    fulls: set[int] = set()
    for info in infos:
        match = versioned.match(info.name or "")
        if match and not info.deleted:
            versions.setdefault(int(match[1]), []).append(info.name)
            if info.description == "full":
                fulls.add(int(match[1]))
    kept = sorted(v for v in fulls if v <= newest_full)[-keep_full:]
    if not kept:
        return
    for version in sorted(v for v in versions if v < kept[0]):
        for name in versions[version]:
            await store.delete(name)
        log.info("policy objects of version %d deleted (keeping full versions %s and later)", version, kept)


async def download_policy(js: JetStreamContext, event: PolicyUpdated, directory: str | Path) -> list[Path]:
    """Fetch the event's objects into ``directory`` and check their digests; the files' paths."""
    import nats.errors
    import nats.js.errors

    if not event.objects or event.bucket is None:
        raise PolicyDownloadError("download_failed", f"policy.updated {event.policy_version} names no objects")
    paths = []
    try:
        store = await js.object_store(event.bucket)
        for obj in event.objects:
            path = Path(directory) / obj.name.rsplit("/", 1)[-1]
            with path.open("wb") as file:
                await store.get(obj.name, writeinto=file)
            paths.append(path)
    except nats.js.errors.DigestMismatchError as exc:  # nats-py's own check against the object's meta
        raise PolicyDownloadError("digest_mismatch", f"an object of policy {event.policy_version} is corrupt") from exc
    except (nats.errors.Error, OSError) as exc:
        raise PolicyDownloadError(
            "download_failed", f"policy {event.policy_version}: {type(exc).__name__}: {exc}"
        ) from exc
    for obj, path in zip(event.objects, paths, strict=True):
        size, digest = await anyio.to_thread.run_sync(_file_digest, path)
        if size != obj.size or digest != obj.sha256:
            raise PolicyDownloadError(
                "digest_mismatch",
                f"{obj.name}: {size} bytes with SHA-256 {digest[:16]}..., the event says {obj.size} bytes, "
                f"{obj.sha256[:16]}...",
            )
    return paths


def _file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


async def policy_history(
    js: JetStreamContext, spec: StreamSpec | None = None, *, adapters: bool = False
) -> list[PolicyUpdated]:
    """Every ``policy.updated`` event of the base (``adapters``: of the LoRA adapters) still on the
    events stream, oldest first."""
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    spec = spec or StreamSpec()
    subject = adapter_subject(spec.prefix) if adapters else policy_subject(spec.prefix)
    try:
        last = await js.get_last_msg(spec.stream, subject)
    except NotFoundError:
        return []
    events: list[PolicyUpdated] = []
    subscription = await js.subscribe(
        subject, stream=spec.stream, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    try:
        while True:
            msg = await subscription.next_msg(timeout=10)
            event = decode_event(msg.data)
            if isinstance(event, PolicyUpdated):
                events.append(event)
            if msg.metadata.sequence.stream >= (last.seq or 0):
                return events
    finally:
        await subscription.unsubscribe()


async def mark_refused(js: JetStreamContext, event: PolicyUpdated, reason: str, detail: str, replica: str) -> bool:
    """Mark ``event``'s version refused in its first object's metadata, unless another replica did
    first; whether this call marked it. Publishers and replicas started later read it back with
    :func:`refusal_mark` (a late replica then skips the version without downloading it)."""
    from nats.js.api import ObjectMeta

    if not event.objects or event.bucket is None:
        return False
    store = await js.object_store(event.bucket)
    name = event.objects[0].name
    info = await store.get_info(name)
    headers = dict(info.headers or {})
    if headers.get(REFUSED_HEADERS[0]):
        return False
    headers.update(zip(REFUSED_HEADERS, ([reason], [replica], [detail[:500]]), strict=True))
    await store.update_meta(name, ObjectMeta(name=name, description=info.description, headers=headers))
    return True


async def refusal_mark(js: JetStreamContext, event: PolicyUpdated) -> tuple[str, str, str] | None:
    """``(reason, replica, detail)`` if a replica marked ``event``'s version refused; else ``None``."""
    import nats.js.errors

    if not event.objects or event.bucket is None:
        return None
    try:
        info = await (await js.object_store(event.bucket)).get_info(event.objects[0].name)
    except nats.js.errors.NotFoundError:
        return None
    headers = info.headers or {}
    values = [headers.get(key) for key in REFUSED_HEADERS]
    if not values[0]:
        return None
    reason, replica, detail = (v[0] if isinstance(v, list) and v else str(v or "") for v in values)
    return reason, replica, detail
