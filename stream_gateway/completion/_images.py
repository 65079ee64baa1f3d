"""A request's images: found, fetched, decoded and processed once, then laid into the prompt.

A chat request's image parts (``image_url`` with a ``data:`` URL, or an ``http(s)`` URL from a
host ``--allow-image-url`` names) become :class:`~pipeline.vision.ProcessedImage` objects, in
the order the chat template renders them: messages in order, parts in order. The template renders
one placeholder token per image; :func:`expand_placeholders` repeats it as many times as the
image has tokens, and :func:`placeholder_spans` finds the runs again in a finished prompt (a
continued conversation's prefix holds its images already expanded: they are never expanded twice).

Deliberate choices:

* Errors name the part (``messages[2].content[1]``) and are 400s: a text-only model, too many
  images, a URL not allowed, bad base64, a format Pillow does not read, an image over
  ``--max-image-bytes`` or, from its header alone, ``--max-image-pixels``.
* Decoding and processing run in worker threads, at most :data:`PROCESSING_THREADS` at a time:
  a burst of large images queues instead of holding dozens of decoded bitmaps at once.
* Processed images are kept by the SHA-256 of their bytes, up to ``--image-cache-bytes``: an agent
  echoes its conversation every turn, and the processor runs once per image, not once per turn.
* URL fetches refuse redirects, private, loopback and link-local addresses (unless the host named
  is one), bodies over the byte limit (read in chunks, never whole), and take at most
  ``--image-fetch-timeout-seconds``.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from urllib.parse import urlsplit

import anyio
import numpy as np
from pipeline.errors import ImageRefused
from pipeline.vision import ImageLimits, ProcessedImage, VisionProcessor, image_digest

from stream_gateway._errors import InvalidRequest
from stream_gateway._metrics import GatewayMetrics
from stream_gateway._settings import Settings
from stream_gateway.completion._request import Message

__all__ = ["ImageResolver", "PromptImage", "RequestImages", "expand_placeholders", "placeholder_spans", "prompt_images"]

PROCESSING_THREADS = 2


@dataclass(frozen=True, slots=True)
class RequestImages:
    """A request's processed images, per message (``by_message[i]``: message ``i``'s, in order)."""

    by_message: tuple[tuple[ProcessedImage, ...], ...]
    token_id: int  # the placeholder the template renders once per image

    def all(self) -> list[ProcessedImage]:
        """Every image, in prompt order."""
        return [image for images in self.by_message for image in images]

    def after(self, position: int) -> list[ProcessedImage]:
        """The images of the messages after ``position``."""
        return [image for images in self.by_message[position + 1 :] for image in images]


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One image of a prompt: processed, and the position of its first placeholder token."""

    image: ProcessedImage
    start: int


def prompt_images(prompt_ids: Sequence[int], images: RequestImages | None) -> tuple[PromptImage, ...]:
    """Each image of a finished prompt with where its placeholder run starts (``()``: no images)."""
    if images is None:
        return ()
    spans = placeholder_spans(prompt_ids, images.token_id)
    ordered = images.all()
    assert len(spans) == len(ordered), "a prompt is built with one placeholder run per image"
    return tuple(PromptImage(image, start) for (start, _), image in zip(spans, ordered, strict=True))


def expand_placeholders(ids: list[int], images: Sequence[ProcessedImage], token_id: int) -> list[int]:
    """``ids`` with the ``i``-th placeholder repeated ``images[i].tokens`` times.

    ``ValueError`` when ``ids`` hold another number of placeholders than there are images (text
    that spells the placeholder token, or a template that renders images otherwise).
    """
    found = ids.count(token_id)
    if found != len(images):
        raise ValueError(f"the rendered prompt holds {found} image placeholders for {len(images)} images")
    if not images:
        return ids
    out: list[int] = []
    image = iter(images)
    for token in ids:
        if token == token_id:
            out.extend([token_id] * next(image).tokens)
        else:
            out.append(token)
    return out


def placeholder_spans(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every run of ``token_id`` in ``ids``."""
    array = np.asarray(ids)
    hits = array == token_id
    if not hits.any():
        return []
    edges = np.diff(np.concatenate(([0], hits.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


class ImageResolver:
    """Turns a request's image parts into processed images, for one served model."""

    def __init__(
        self,
        processor: VisionProcessor | None,
        settings: Settings,
        model: str,
        metrics: GatewayMetrics,
        remote: bool = False,
    ) -> None:
        self._processor = processor
        self._metrics = metrics
        self._why_not = f"the served model `{model}` does not take images here (a text-only model; docs/images.md)"
        if remote:
            # vLLM's /v1/completions takes prompt ids or images, never both; the gateway will not let
            # a server re-render the conversation (docs/images.md, "Remote engines").
            self._why_not = (
                "this engine sends no images to its servers: their token-in APIs take no images with the "
                "prompt ids the gateway builds (docs/images.md)"
            )
        self._limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels)
        self._max_images = settings.max_images_per_request
        self._hosts = frozenset(h.lower() for h in settings.allow_image_urls)
        self._fetch_timeout = settings.image_fetch_timeout_seconds
        self._cache: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._cache_budget = settings.image_cache_bytes
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache is shared by the processing threads
        self._threads = anyio.CapacityLimiter(PROCESSING_THREADS)

    async def resolve(self, messages: Sequence[Message], imageless: int = 0) -> RequestImages | None:
        """The request's images (``None``: it has none); an :class:`InvalidRequest` names a bad part.
        ``imageless``: how many leading messages are known to hold none (a kept history's)."""
        if not any(m.content is not None and not isinstance(m.content, str) for m in islice(messages, imageless, None)):
            return None  # text only (the common case, checked without building the parts)
        parts = [
            [(f"messages[{i}].content[{j}]", part.image_url.url) for j, part in m.images()]
            for i, m in enumerate(messages)
        ]
        count = sum(len(p) for p in parts)
        if not count:
            return None
        first = next(where for p in parts for where, _ in p)
        if self._processor is None:
            raise InvalidRequest(
                f"{first}: {self._why_not}",
                param=first,
                code="images_not_supported",
            )
        if count > self._max_images:
            raise InvalidRequest(
                f"{count} images in one request; at most {self._max_images} are accepted (--max-images-per-request)",
                param=first,
            )
        raw = [[(where, await self._bytes(where, url)) for where, url in p] for p in parts]
        by_message = await anyio.to_thread.run_sync(self._process_all, raw, limiter=self._threads)
        self._metrics.images.inc(count)
        return RequestImages(by_message, self._processor.token_id)

    # -- bytes -------------------------------------------------------------------------------

    async def _bytes(self, where: str, url: str) -> bytes:
        if url.startswith("data:"):
            return _data_url_bytes(where, url, self._limits.max_bytes)
        scheme = urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            return await self._fetch(where, url)
        raise InvalidRequest(
            f"{where}: an image URL must be a data: URL or http(s), not {scheme or url[:16]!r}", param=where
        )

    async def _fetch(self, where: str, url: str) -> bytes:
        import httpx

        split = urlsplit(url)
        host = (split.hostname or "").lower()
        if host not in self._hosts:
            raise InvalidRequest(
                f"{where}: image URLs from {host or 'this URL'} are not fetched; send the image as a data: URL "
                "(or start the gateway with --allow-image-url HOST)",
                param=where,
                code="image_url_not_allowed",
            )
        await self._check_address(where, host, split.port or (443 if split.scheme == "https" else 80))
        limit = self._limits.max_bytes
        try:
            with anyio.fail_after(self._fetch_timeout):
                async with (
                    httpx.AsyncClient(follow_redirects=False, timeout=self._fetch_timeout) as client,
                    client.stream("GET", url) as response,
                ):
                    if response.status_code != 200:
                        raise InvalidRequest(
                            f"{where}: fetching the image answered HTTP {response.status_code}", param=where
                        )
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > limit:
                            raise InvalidRequest(
                                f"{where}: the image is over {limit} bytes (--max-image-bytes)", param=where
                            )
                        chunks.append(chunk)
                    return b"".join(chunks)
        except TimeoutError as exc:
            raise InvalidRequest(
                f"{where}: the image URL did not answer in {self._fetch_timeout:g} s", param=where
            ) from exc
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"{where}: the image URL cannot be fetched: {exc}", param=where) from exc

    async def _check_address(self, where: str, host: str, port: int) -> None:
        """A named host may be anything; a name that resolves to a private address may not."""
        try:
            ipaddress.ip_address(host)
            return  # an address named in --allow-image-url: the operator said so
        except ValueError:
            pass
        if host == "localhost":
            return
        try:
            infos = await anyio.getaddrinfo(host, port)
        except OSError as exc:
            raise InvalidRequest(f"{where}: the image URL's host does not resolve: {exc}", param=where) from exc
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if address.is_private or address.is_loopback or address.is_link_local or address.is_reserved:
                raise InvalidRequest(
                    f"{where}: {host} resolves to a private address ({address}); name the address itself in "
                    "--allow-image-url to allow it",
                    param=where,
                    code="image_url_not_allowed",
                )

    # -- processing (worker threads) ---------------------------------------------------------

    def _process_all(self, raw: list[list[tuple[str, bytes]]]) -> tuple[tuple[ProcessedImage, ...], ...]:
        return tuple(tuple(self._process(where, data) for where, data in message) for message in raw)

    def _process(self, where: str, data: bytes) -> ProcessedImage:
        assert self._processor is not None
        digest = image_digest(data)
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                return hit
        try:
            image = self._processor.process(data, self._limits)
        except ImageRefused as exc:
            raise InvalidRequest(f"{where}: {exc}", param=where, code="invalid_image") from exc
        self._metrics.images_processed.inc()
        with self._lock:
            if image.nbytes <= self._cache_budget and digest not in self._cache:
                self._cache[digest] = image
                self._cached_bytes += image.nbytes
                while self._cached_bytes > self._cache_budget:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.nbytes
        return image


def _data_url_bytes(where: str, url: str, limit: int) -> bytes:
    header, comma, body = url.partition(",")
    if not comma:
        raise InvalidRequest(f"{where}: a data: URL needs a comma before its data", param=where)
    kind = header[5:].split(";")
    if ";base64" not in header or not kind[0].startswith("image/"):
        raise InvalidRequest(f"{where}: expected data:image/<format>;base64,<data>", param=where)
    if len(body) > (limit + 2) // 3 * 4 + 4:  # base64 longer than the largest image: refused before decoding
        raise InvalidRequest(f"{where}: the image is over {limit} bytes (--max-image-bytes)", param=where)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{where}: the image data is not valid base64", param=where) from exc
