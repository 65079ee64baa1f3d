"""What an image costs a request: time to first token, CPU, bytes stored, and memory under a burst.

Run (from the repository root, after ``bash scripts/install.sh``; ``tiny-vl`` is built on first use)::

    .venv/bin/python benchmarks/images.py
    .venv/bin/python benchmarks/images.py --requests 40 --repeats 5 --burst 50 --json images.json

Set-up, all real processes on this machine: an embedded ``nats-server`` (JetStream, temp store) and
one gateway serving the built-in ``tiny-vl`` on the ``transformers`` engine, capturing to it.

1. **Per request** (sequential streamed chat requests from this process, ``max_tokens`` 8): text
   only; one new image (a 224 x 224 PNG never sent before: decode, processor, hash, storage);
   the same image again (processed already: the cache by hash). Kinds alternate within every
   repeat. Reported: median time to first token at the client, and the gateway's CPU seconds per
   request (``/proc``, the kind's requests together), medians over repeats, and as ratios to text.
2. **Bytes per image**: what the image store holds per image (its bytes, as sent) against the
   processed ``pixel_values`` it stands for (float32; and zlib-compressed), for tiny-vl's processor
   and for Qwen2-VL's default one (``min_pixels`` 3136, ``max_pixels`` 12,845,056) on the same
   inputs: a 224 x 224 photo-like PNG, a 1280 x 800 screenshot-like PNG, and a 1 MB noisy JPEG.
   This is the measurement behind storing bytes plus a pixel digest, not tensors (docs/images.md).
3. **Burst**: ``--burst`` concurrent requests, each with a different ~1 MB image; the gateway's
   RSS before, at its peak (polled every 50 ms) and after, and the errors (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from _procs import cpu_s, free_port, rss_mb, wait_http

from pipeline.embedded import EmbeddedNatsServer
from pipeline.vision import ImageLimits, VisionProcessor
from stream_gateway.models import resolve_model, vl_image

MODEL = "tiny-vl"


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def noisy_jpeg(seed: int, target: int = 1_000_000) -> bytes:
    """A JPEG of about ``target`` bytes: random pixels compress badly."""
    side = int((target / 0.9) ** 0.5 / 1.1)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def screenshot() -> bytes:
    """A 1280 x 800 screenshot-like image: flat panels, text-like stripes."""
    image = Image.new("RGB", (1280, 800), (245, 245, 245))
    pixels = np.asarray(image).copy()
    rng = np.random.default_rng(7)
    for row in range(40, 780, 18):
        width = int(rng.integers(200, 1100))
        pixels[row : row + 9, 60 : 60 + width] = rng.integers(0, 90, 3)
    pixels[:36] = (40, 60, 120)
    return png(Image.fromarray(pixels))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat_body(image: bytes | None, media_type: str = "image/png") -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What colour is this image?"}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image, media_type)}})
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }


def first_token_s(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """Seconds until the first content frame of a streamed request (the rest is read too)."""
    started = time.perf_counter()
    first: float | None = None
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=HEADERS) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


HEADERS = {"authorization": "Bearer sk-bench"}


def per_request(url: str, pid: int, requests: int, repeats: int, seed: int) -> dict[str, Any]:
    kinds = ("text", "new image", "same image")
    ttft: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    same = png(vl_image("green", (224, 224), seed=seed))
    counter = 0
    with httpx.Client(timeout=120) as client:
        first_token_s(client, url, chat_body(same))  # warm: the same image is processed once
        for _ in range(repeats):
            for kind in kinds:
                times = []
                before = cpu_s(pid)
                for _ in range(requests):
                    counter += 1
                    image = None
                    if kind == "new image":
                        image = png(vl_image("red", (224, 224), seed=seed + counter))
                    elif kind == "same image":
                        image = same
                    times.append(first_token_s(client, url, chat_body(image)))
                cpu[kind].append((cpu_s(pid) - before) / requests)
                ttft[kind].append(statistics.median(times))
    out: dict[str, Any] = {}
    for kind in kinds:
        out[kind] = {"ttft_ms": statistics.median(ttft[kind]) * 1e3, "cpu_ms": statistics.median(cpu[kind]) * 1e3}
    for kind in kinds[1:]:
        out[kind]["ttft_vs_text"] = out[kind]["ttft_ms"] / out["text"]["ttft_ms"]
        out[kind]["cpu_vs_text"] = out[kind]["cpu_ms"] / out["text"]["cpu_ms"]
    return out


def bytes_per_image(model_dir: str) -> dict[str, Any]:
    from transformers import Qwen2VLImageProcessorPil

    tiny = VisionProcessor.from_model(model_dir, 0)
    qwen = VisionProcessor(Qwen2VLImageProcessorPil(), 0)  # Qwen2-VL's defaults
    inputs = {
        "photo 224x224 png": png(vl_image("blue", (224, 224), seed=3)),
        "screenshot 1280x800 png": screenshot(),
        "noise ~1MB jpeg": noisy_jpeg(11),
    }
    out: dict[str, Any] = {}
    for name, data in inputs.items():
        row: dict[str, Any] = {"stored_bytes": len(data)}
        for label, processor in (("tiny-vl", tiny), ("qwen2-vl default", qwen)):
            started = time.perf_counter()
            image = processor.process(data, ImageLimits(max_bytes=50 * 2**20))
            seconds = time.perf_counter() - started
            raw = image.pixel_values.nbytes
            packed = len(zlib.compress(image.pixel_values.tobytes(), 6))
            row[label] = {
                "tokens": image.tokens,
                "pixel_values_bytes": raw,
                "pixel_values_zlib_bytes": packed,
                "tensor_vs_stored": raw / len(data),
                "process_ms": seconds * 1e3,
            }
        out[name] = row
    return out


def burst(url: str, pid: int, count: int, seed: int) -> dict[str, Any]:
    images = [noisy_jpeg(seed + i) for i in range(count)]
    peak = [rss_mb(pid)]
    before = rss_mb(pid)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak.append(rss_mb(pid))
            time.sleep(0.05)

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(data: bytes) -> str | None:
                body = {**chat_body(data, "image/jpeg"), "stream": False}
                response = await client.post(url + "/v1/chat/completions", json=body, headers=HEADERS)
                return None if response.status_code == 200 else f"{response.status_code}: {response.text[:200]}"

            return list(await asyncio.gather(*(one(d) for d in images)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    results = asyncio.run(run())
    elapsed = time.perf_counter() - started
    stop.set()
    watcher.join()
    errors = [r for r in results if r is not None]
    return {
        "requests": count,
        "image_bytes_median": int(statistics.median(len(d) for d in images)),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "seconds": elapsed,
        "rss_before_mb": before,
        "rss_peak_mb": max(peak),
        "rss_after_mb": rss_mb(pid),
    }


def wait_published(url: str, timeout: float = 60.0) -> None:
    """Until the gateway has nothing left to publish (its events and image objects are in NATS)."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health", timeout=10).json()["events"]["pending"] and time.monotonic() < deadline:
        time.sleep(0.05)


def stored_objects(nats_url: str) -> dict[str, int]:
    import nats

    async def sizes() -> dict[str, int]:
        nc = await nats.connect(nats_url)
        try:
            store = await nc.jetstream().object_store("sg_images")
            return {info.name: int(info.size or 0) for info in await store.list()}
        finally:
            await nc.close()

    return asyncio.run(sizes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="requests per kind per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--burst", type=int, default=50, help="concurrent requests with ~1 MB images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    model_dir = resolve_model(MODEL)
    results: dict[str, Any] = {"bytes_per_image": bytes_per_image(model_dir)}
    with tempfile.TemporaryDirectory() as scratch, EmbeddedNatsServer() as server:
        port = free_port()
        command = [sys.executable, "-m", "stream_gateway.cli", "serve", "--engine", "transformers",
                   "--model", model_dir, "--served-model-name", MODEL, "--port", str(port),
                   "--log-level", "warning", "--nats-url", server.url, "--outbox-dir", str(Path(scratch) / "outbox"),
                   "--max-request-bytes", str(16 * 2**20), "--max-image-pixels", str(50_000_000)]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", process, timeout=300)
            results["per_request"] = per_request(url, process.pid, args.requests, args.repeats, args.seed)
            results["burst"] = burst(url, process.pid, args.burst, args.seed + 10_000)
            wait_published(url)
            objects = stored_objects(server.url)
            images = {k: v for k, v in objects.items() if k.startswith("images/")}
            results["image_store"] = {
                "objects": len(images),
                "distinct_images_sent": 1 + args.repeats * args.requests + args.burst,
                "bytes_median": int(statistics.median(images.values())) if images else 0,
            }
        finally:
            process.terminate()
            process.wait(timeout=30)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
