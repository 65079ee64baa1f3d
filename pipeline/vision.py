"""Images as a vision-language model sees them: one decode, one processor, one digest.

The gateway and the consumers both run this module, so that what a trainer rebuilds from a
recorded image is, provably, what the policy saw (docs/images.md):

* :func:`open_image` decodes the bytes a client sent (PNG, JPEG, WebP, GIF's first frame) under
  :class:`ImageLimits`: the byte size first, then the pixel count from the header, before a single
  pixel is decoded, so a decompression bomb costs a header read;
* :class:`VisionProcessor` is the served model's own image processor (loaded from the model
  directory, or rebuilt from the configuration recorded with the traffic), with a
  :attr:`~VisionProcessor.fingerprint` of that configuration and the library versions;
* :func:`pixels_digest` is the SHA-256 of the ``pixel_values`` bytes the model consumed: it is
  recorded per image, and a consumer that processes the stored bytes again checks it (a processor
  or Pillow version that resizes differently is caught, never trained on).

Deliberate choices:

* What is stored is the image's *bytes* (keyed by their SHA-256), not the processed tensors: a
  1 MB screenshot becomes ~25 MB of float32 ``pixel_values`` for Qwen2-VL at its default
  resolution (``benchmarks/images.py`` measures both). Exactness comes from the recorded digest of
  the tensors, not from storing them.
* Pillow's :class:`~PIL.Image.DecompressionBombWarning` is made an error for this process at
  import: a warning in a worker thread would be lost, and the pixel limit here is lower anyway.
* ``transformers`` is imported lazily: consumers that never see an image do not pay for it.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from PIL import Image, UnidentifiedImageError

from .errors import ImageRefused

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

__all__ = [
    "FORMATS",
    "ImageLimits",
    "ImageRefused",
    "ProcessedImage",
    "VisionProcessor",
    "image_digest",
    "open_image",
    "pixels_digest",
]

warnings.filterwarnings("error", category=Image.DecompressionBombWarning)

# Pillow's format names -> the media types clients send.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one image may be (``--max-image-bytes``, ``--max-image-pixels``)."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # width x height as the header says it, before decoding


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image after the model's processor: what the vision tower consumes and what is recorded."""

    sha256: str  # of the bytes the client sent
    data: bytes = field(repr=False, compare=False)  # those bytes: what the image store keeps
    media_type: str
    width: int
    height: int
    pixel_values: np.ndarray  # float32 [patches, channels * temporal_patch * patch * patch]
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    tokens: int  # placeholder tokens in the prompt: the grid's patches after the spatial merge
    pixels_sha256: str  # pixels_digest(pixel_values)
    processor: str  # VisionProcessor.fingerprint

    @property
    def nbytes(self) -> int:
        """Memory the processed image holds (its bytes and its pixel values)."""
        return int(self.pixel_values.nbytes) + len(self.data)


def image_digest(data: bytes) -> str:
    """The SHA-256 of an image's bytes, hex: its name in the image store."""
    return hashlib.sha256(data).hexdigest()


def pixels_digest(pixel_values: np.ndarray) -> str:
    """The SHA-256 of processed pixels (float32, C order), hex."""
    return hashlib.sha256(np.ascontiguousarray(pixel_values, dtype=np.float32).tobytes()).hexdigest()


def open_image(data: bytes, limits: ImageLimits) -> tuple[PILImage, str]:
    """Decode ``data`` (its first frame) and its media type; :class:`ImageRefused` with the reason.

    The size in bytes and the pixel count in the header are checked before anything is decoded.
    """
    if len(data) > limits.max_bytes:
        raise ImageRefused(f"the image is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageRefused(f"the image is too large to decode: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageRefused("not a PNG, JPEG, WebP or GIF image (or a corrupt one)") from exc
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageRefused("the image has no pixels")
    if width * height > limits.max_pixels:
        raise ImageRefused(
            f"the image is {width}x{height} = {width * height} pixels; at most {limits.max_pixels} are accepted"
        )
    media_type = FORMATS[str(image.format)]
    try:
        image.seek(0)  # an animated GIF or WebP: its first frame
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # what Pillow raises for truncated or bad data
        raise ImageRefused(f"the image cannot be decoded: {exc}") from exc
    return image, media_type


class VisionProcessor:
    """A vision-language model's image processor, as both the gateway and a trainer run it."""

    def __init__(self, processor: Any, token_id: int) -> None:
        self._processor = processor
        self.token_id = token_id  # the placeholder the prompt repeats once per image token
        self.merge_size = int(getattr(processor, "merge_size", 1) or 1)
        self.config = _jsonable(processor.to_dict())
        self.class_name = type(processor).__name__
        self.fingerprint = self._fingerprint()

    @classmethod
    def from_model(cls, model_dir: str, token_id: int) -> VisionProcessor:
        """The image processor saved with the model in ``model_dir``.

        The class its ``preprocessor_config.json`` names; without torchvision, that class's Pillow
        twin (``Qwen2VLImageProcessorPil``), which transformers would pick with a warning.
        """
        from importlib.util import find_spec
        from pathlib import Path

        import transformers

        saved = orjson.loads((Path(model_dir) / "preprocessor_config.json").read_bytes())
        name = str(saved.get("image_processor_type", ""))
        if find_spec("torchvision") is None and not name.endswith("Pil") and hasattr(transformers, name + "Pil"):
            name += "Pil"
        kind = getattr(transformers, name, None)
        if kind is None:
            raise ImageRefused(f"{model_dir}: this transformers has no image processor {name!r}")
        return cls(kind.from_pretrained(model_dir), token_id)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> VisionProcessor:
        """The processor :meth:`record` describes (what the gateway stored beside the images)."""
        import transformers

        kind = getattr(transformers, str(record["class"]), None)
        if kind is None:
            raise ImageRefused(f"this transformers has no image processor {record['class']!r}")
        return cls(kind.from_dict(dict(record["config"])), int(record["token_id"]))

    def record(self) -> dict[str, Any]:
        """Everything needed to run this processor again: class, configuration, versions."""
        return {
            "class": self.class_name,
            "config": self.config,
            "token_id": self.token_id,
            "versions": _versions(),
            "fingerprint": self.fingerprint,
        }

    def process(self, data: bytes, limits: ImageLimits) -> ProcessedImage:
        """Decode and process one image (slow: run it off the event loop)."""
        image, media_type = open_image(data, limits)
        try:
            out = self._processor(images=[image], return_tensors="np")
        except (ValueError, OSError) as exc:  # e.g. an image smaller than one patch after all
            raise ImageRefused(f"the model's image processor refused the image: {exc}") from exc
        pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        t, h, w = (int(x) for x in np.asarray(out["image_grid_thw"]).reshape(-1)[:3])
        return ProcessedImage(
            sha256=image_digest(data),
            data=data,
            media_type=media_type,
            width=image.size[0],
            height=image.size[1],
            pixel_values=pixel_values,
            grid_thw=(t, h, w),
            tokens=t * h * w // (self.merge_size * self.merge_size),
            pixels_sha256=pixels_digest(pixel_values),
            processor=self.fingerprint,
        )

    def _fingerprint(self) -> str:
        body = {"class": self.class_name, "config": self.config, "token_id": self.token_id, "versions": _versions()}
        return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def _versions() -> dict[str, str]:
    import PIL
    import transformers

    return {"transformers": transformers.__version__, "pillow": PIL.__version__}


def _jsonable(value: Any) -> Any:
    """A processor configuration as plain JSON (enums as their values, tuples as lists)."""
    return orjson.loads(orjson.dumps(value, default=_plain, option=orjson.OPT_SORT_KEYS))


def _plain(value: Any) -> Any:
    if hasattr(value, "value"):  # PIL's Resampling and other enums
        return value.value
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"cannot record {type(value).__name__} in a processor configuration")
