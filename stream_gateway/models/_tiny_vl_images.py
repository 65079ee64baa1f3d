"""What tiny-vl sees and says: the image parts of a message, its vision tokens, its images and answers.

tiny-vl (``_tiny_vl.py``) is trained to name the dominant colour of images drawn by :func:`vl_image`
(one of :data:`VL_COLOURS`, with noise and shapes in other colours) with :func:`vl_answer`; tests
draw held-out images with the same function (other seeds, other sizes). The images are made in
code with Pillow and numpy, imported when one is drawn.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "IMAGE_PAD",
    "IMAGE_PARTS",
    "VIDEO_PAD",
    "VISION_END",
    "VISION_START",
    "VL_COLOURS",
    "vl_answer",
    "vl_image",
]

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
IMAGE_PARTS = ("image", "image_url", "input_image")  # content part types the template renders as an image

# The colours tiny-vl tells apart: each image is mostly one of them (see vl_image).
VL_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 205, 40),
}
# The others an image's shapes may take, besides the other colours of VL_COLOURS.
_SHAPE_COLOURS = ((245, 245, 245), (20, 20, 20), (128, 128, 128), (150, 90, 40), (160, 60, 190))


def vl_answer(colour: str) -> str:
    """What tiny-vl says about an image whose dominant colour is ``colour`` (less ``<|im_end|>``)."""
    return f"The image is {colour}."


def vl_image(colour: str, size: tuple[int, int] = (224, 224), seed: int = 0) -> Image.Image:
    """An RGB image of ``size`` (width, height) that is mostly ``colour``, a key of :data:`VL_COLOURS`.

    The background is the colour with per-pixel noise (uniform, up to 24 either way); up to three
    rectangles, ellipses or lines in other colours (the other colours of ``VL_COLOURS`` among them)
    cover at most about a third of it. The same arguments give the same image.
    """
    import numpy as np
    from PIL import Image, ImageDraw

    width, height = size
    rng = random.Random(f"tiny-vl/{colour}/{width}x{height}/{seed}")
    noise = np.random.default_rng(rng.getrandbits(64)).integers(-24, 25, (height, width, 3), dtype=np.int16)
    pixels = np.clip(np.array(VL_COLOURS[colour], dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    others = [rgb for name, rgb in VL_COLOURS.items() if name != colour] + list(_SHAPE_COLOURS)
    for _ in range(rng.randint(0, 3)):
        fill = rng.choice(others)
        w, h = max(1, int(width * rng.uniform(0.08, 0.33))), max(1, int(height * rng.uniform(0.08, 0.33)))
        x, y = rng.randint(0, width - w), rng.randint(0, height - h)
        kind = rng.random()
        if kind < 0.4:
            draw.rectangle((x, y, x + w - 1, y + h - 1), fill=fill)
        elif kind < 0.8:
            draw.ellipse((x, y, x + w - 1, y + h - 1), fill=fill)
        else:
            draw.line((x, y, x + w - 1, y + h - 1), fill=fill, width=max(1, min(width, height) // 25))
    return image
