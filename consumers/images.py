"""A trajectory's images, fetched from the image bucket and processed again, exactly as the policy saw them.

Each image is processed once between sampling and training: by the trainer, which needs the pixels
(:meth:`ImageStore.resolve`). The batcher only checks what needs no processing
(:meth:`ImageStore.check`: the objects exist, the stored digest is the image's name, the processor
rebuilds, the row's runs are its placeholder), so a missing object is dropped there, row by row;
the pixel check runs where the pixels are made, on the trainer's own libraries.

The gateway stores every image's bytes as ``images/<sha256>`` and its model's image processor as
``processors/<fingerprint>`` (:meth:`pipeline.vision.VisionProcessor.record`) in the ``sg_images``
object store, before the turn events that name them. :class:`ImageStore` fetches both for each
:class:`~consumers.trajectory.TrajectoryImage`, rebuilds the processor
(:meth:`~pipeline.vision.VisionProcessor.from_record`), runs it on the bytes and checks, in order:

1. the objects exist (:class:`ImagesRefused` with ``missing=True`` otherwise);
2. the bytes' SHA-256 is their name, and they decode to the recorded media type and size;
3. the processor's grid and token count are the recorded ones, and the trajectory's run of ids
   at ``start`` is the processor's placeholder (its record's ``token_id``);
4. the SHA-256 of the float32 pixel values equals ``pixels_sha256``: another transformers or
   Pillow that resizes or normalizes differently is caught here, never trained on.

What it returns (:class:`ResolvedImage`: pixel values, grid, the spatial merge size and the
placeholder id) is what :mod:`consumers.verl_vision` lays out for verl.

Deliberate choices:

* The fingerprint of the rebuilt processor is not compared with the recorded one: it covers the
  library versions, which may differ harmlessly. The pixel digest decides.
* An image is decoded under limits of its own recorded size (its byte count and width x height):
  the gateway accepted it under its limits, which the consumer does not know.
* Caches, both bounded: processors by fingerprint (:data:`PROCESSORS_KEPT`), processed images by
  SHA-256 and processor up to ``cache_bytes`` (least recently used first out). A GRPO group
  shares its prompt's images and an agent's later turns repeat its earlier ones: the processor
  runs once per image, not once per row.
* Processing runs in worker threads, at most :data:`PROCESSING_THREADS` at a time; fetching has a
  time limit (``timeout_s``) whose :class:`TimeoutError` propagates, as NATS errors do: those are
  the connection's trouble, to retry, not the trajectory's.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import orjson
from pipeline.errors import ImageRefused
from pipeline.vision import ImageLimits, ProcessedImage, VisionProcessor, image_digest

from .errors import ImagesRefused

if TYPE_CHECKING:
    import numpy.typing as npt
    from nats.js import JetStreamContext
    from nats.js.object_store import ObjectStore

    from .trajectory import Trajectory, TrajectoryImage

__all__ = ["ImageStore", "ImageStoreStatistics", "ImagesRefused", "ResolvedImage"]

PROCESSORS_KEPT = 16
PROCESSING_THREADS = 2


@dataclass(frozen=True, slots=True)
class ResolvedImage:
    """One image of a trajectory, processed again and checked: what the vision tower consumes."""

    record: TrajectoryImage
    pixel_values: npt.NDArray[np.float32]  # [patches, channels * temporal_patch * patch * patch]
    merge_size: int  # the processor's spatial merge (Qwen2-VL's config.vision_config.spatial_merge_size)
    token_id: int  # the placeholder id its run of tokens repeats

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """Patches along time, height and width."""
        return self.record.grid_thw


@dataclass(frozen=True, slots=True)
class ImageStoreStatistics:
    """Counters since start."""

    fetched: int  # image objects read from the bucket
    processed: int  # images run through a processor (cache misses)
    cache_hits: int
    checked: int  # images checked without processing (ImageStore.check: the batcher's)
    cached: int  # processed images held now
    cached_bytes: int
    refused_missing: int  # trajectories refused for a missing object
    refused_mismatch: int  # trajectories refused for images that differ from their record


class ImageStore:
    """The images of trajectories, from one bucket (see the module docstring)."""

    def __init__(
        self, js: JetStreamContext, bucket: str = "sg_images", *, cache_bytes: int = 256 << 20, timeout_s: float = 60.0
    ) -> None:
        self._js = js
        self._bucket = bucket
        self._store: ObjectStore | None = None
        self._timeout_s = timeout_s
        self._processors: OrderedDict[str, VisionProcessor] = OrderedDict()
        self._cache: OrderedDict[tuple[str, str], ProcessedImage] = OrderedDict()
        self._cache_budget = cache_bytes
        self._cached_bytes = 0
        self._threads = anyio.CapacityLimiter(PROCESSING_THREADS)
        self._counts = dict.fromkeys(
            ("fetched", "processed", "cache_hits", "checked", "refused_missing", "refused_mismatch"), 0
        )

    def statistics(self) -> ImageStoreStatistics:
        """A snapshot of the counters."""
        return ImageStoreStatistics(**self._counts, cached=len(self._cache), cached_bytes=self._cached_bytes)

    async def resolve(self, trajectory: Trajectory) -> list[ResolvedImage]:
        """The trajectory's images, in order, checked (``[]``: it has none); :class:`ImagesRefused` says why not."""
        resolved = []
        for i, image in enumerate(trajectory.images):
            with self._refusing(trajectory, i):
                resolved.append(await self._resolve(trajectory, image))
        return resolved

    async def check(self, trajectory: Trajectory) -> None:
        """What can be checked without processing, which is the trainer's (:meth:`resolve`) to do
        once: every object exists, the image's stored digest is its name, the processor rebuilds
        here, and the row's runs are its placeholder. :class:`ImagesRefused` says why not."""
        for i, image in enumerate(trajectory.images):
            with self._refusing(trajectory, i):
                processor = await self._processor(image.processor)
                _check_placeholder(trajectory, image, processor)
                await self._check_stored(image.sha256)
            self._counts["checked"] += 1

    @contextmanager
    def _refusing(self, trajectory: Trajectory, index: int) -> Iterator[None]:
        """A missing object or a mismatch of image ``index`` as the trajectory's refusal, counted."""
        try:
            yield
        except _Missing as exc:
            self._counts["refused_missing"] += 1
            raise ImagesRefused(trajectory.trajectory_id, f"images[{index}]: {exc}", missing=True) from exc
        except _Mismatch as exc:
            self._counts["refused_mismatch"] += 1
            raise ImagesRefused(trajectory.trajectory_id, f"images[{index}]: {exc}", missing=False) from exc

    async def resolve_all(self, trajectories: Sequence[Trajectory]) -> list[list[ResolvedImage]]:
        """Every trajectory's images (row by row); the first refusal is raised."""
        return [await self.resolve(trajectory) for trajectory in trajectories]

    # -- one image -----------------------------------------------------------------------------

    async def _resolve(self, trajectory: Trajectory, image: TrajectoryImage) -> ResolvedImage:
        processor = await self._processor(image.processor)
        _check_placeholder(trajectory, image, processor)
        key = (image.sha256, image.processor)
        processed = self._cache.get(key)  # the caches live on the event loop: no lock
        if processed is not None:
            self._cache.move_to_end(key)
            self._counts["cache_hits"] += 1
        if processed is None:
            data = await self._get(f"images/{image.sha256}", "image")
            if image_digest(data) != image.sha256:
                raise _Mismatch(f"the stored bytes of images/{image.sha256} have another SHA-256")
            limits = ImageLimits(max_bytes=len(data), max_pixels=image.width * image.height)
            try:
                processed = await anyio.to_thread.run_sync(processor.process, data, limits, limiter=self._threads)
            except (ImageRefused, TypeError, ImportError) as exc:  # a configuration this transformers runs otherwise
                raise _Mismatch(f"images/{image.sha256} cannot be processed again: {exc}") from exc
            self._counts["processed"] += 1
            self._keep(key, processed)
        _check(image, processed)
        return ResolvedImage(image, processed.pixel_values, processor.merge_size, processor.token_id)

    async def _processor(self, fingerprint: str) -> VisionProcessor:
        processor = self._processors.get(fingerprint)
        if processor is not None:
            self._processors.move_to_end(fingerprint)
            return processor
        raw = await self._get(f"processors/{fingerprint}", "processor")
        try:
            record: dict[str, Any] = orjson.loads(raw)
            processor = VisionProcessor.from_record(record)
        # ImageRefused is a ValueError; ImportError: a class that needs a library missing here (torchvision)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, ImportError) as exc:
            raise _Mismatch(f"processors/{fingerprint} cannot be rebuilt here: {exc}") from exc
        self._processors[fingerprint] = processor
        if len(self._processors) > PROCESSORS_KEPT:
            self._processors.popitem(last=False)
        return processor

    async def _check_stored(self, sha256: str) -> None:
        """``images/<sha256>`` exists and its stored digest (the object store's own SHA-256 of the
        bytes) is its name: read from the object's info, the bytes not fetched."""
        from nats.js.errors import NotFoundError

        name = f"images/{sha256}"
        try:
            with anyio.fail_after(self._timeout_s):
                if self._store is None:
                    self._store = await self._js.object_store(self._bucket)
                info = await self._store.get_info(name)
        except NotFoundError as exc:
            raise _Missing(f"the image object {name} is not in bucket {self._bucket}") from exc
        digest = (info.digest or "").partition("=")[2]
        if digest and base64.urlsafe_b64decode(digest).hex() != sha256:
            raise _Mismatch(f"the stored bytes of {name} have another SHA-256")

    async def _get(self, name: str, what: str) -> bytes:
        from nats.js.errors import DigestMismatchError, NotFoundError

        try:
            with anyio.fail_after(self._timeout_s):
                if self._store is None:
                    self._store = await self._js.object_store(self._bucket)
                result = await self._store.get(name)
        except NotFoundError as exc:  # the bucket or the object (BucketNotFoundError, ObjectNotFoundError, deleted)
            raise _Missing(f"the {what} object {name} is not in bucket {self._bucket}") from exc
        except DigestMismatchError as exc:
            raise _Mismatch(f"the {what} object {name} in bucket {self._bucket} is corrupt") from exc
        if name.startswith("images/"):
            self._counts["fetched"] += 1
        return bytes(result.data or b"")

    def _keep(self, key: tuple[str, str], processed: ProcessedImage) -> None:
        size = processed.nbytes
        if size > self._cache_budget or key in self._cache:
            return
        self._cache[key] = processed
        self._cached_bytes += size
        while self._cached_bytes > self._cache_budget:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes


class _Missing(LookupError):
    pass


class _Mismatch(ValueError):
    pass


def _check_placeholder(trajectory: Trajectory, image: TrajectoryImage, processor: VisionProcessor) -> None:
    run = trajectory.token_ids[image.start : image.end]
    if run != [processor.token_id] * image.tokens:
        raise _Mismatch(
            f"token ids {image.start}..{image.end} are not {image.tokens} copies of the processor's "
            f"placeholder {processor.token_id}"
        )


def _check(image: TrajectoryImage, processed: ProcessedImage) -> None:
    """The processed image against its record: what was decoded, the grid, the tokens, the pixels."""
    decoded = (processed.media_type, processed.width, processed.height)
    if decoded != (image.media_type, image.width, image.height):
        raise _Mismatch(
            f"images/{image.sha256} decodes to {decoded[0]} {decoded[1]}x{decoded[2]}, recorded as "
            f"{image.media_type} {image.width}x{image.height}"
        )
    if processed.grid_thw != image.grid_thw or processed.tokens != image.tokens:
        raise _Mismatch(
            f"images/{image.sha256} makes a grid of {list(processed.grid_thw)} ({processed.tokens} tokens) here, "
            f"recorded as {list(image.grid_thw)} ({image.tokens} tokens): this processor resizes differently"
        )
    if processed.pixels_sha256 != image.pixels_sha256:
        raise _Mismatch(
            f"images/{image.sha256}: the pixel values processed here differ from those the policy consumed "
            f"(pixels_sha256 {processed.pixels_sha256[:12]}... here, {image.pixels_sha256[:12]}... recorded): "
            "another transformers or Pillow processes this image differently"
        )
