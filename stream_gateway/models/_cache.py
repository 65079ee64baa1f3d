"""The build cache: a model directory is built once, in a temp dir renamed into place.

A directory counts as complete only when its marker file, written last, names the builder's
current version (see the package docstring for why).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["MARKER_FILE", "default_cache_dir"]

MARKER_FILE = "stream_gateway_model.json"

_STALE_BUILD_SECONDS = 3600.0

log = logging.getLogger("stream_gateway.models")


def default_cache_dir() -> Path:
    """The cache used when a caller passes no ``cache_dir``."""
    return Path.home() / ".cache" / "stream-gateway" / "models"


def _cached_build(cache_dir: Path | None, name: str, version: int, build: Callable[[Path], None]) -> Path:
    """Return ``cache_dir/name`` if complete; otherwise build it in a temp dir and rename it there."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / name
    if _is_complete(final, version):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_builds(root, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    # A fine-tuned test model takes a minute or two to build on first use: say so, and when it is done
    # (``serve --model tiny-agent`` was silent for two minutes).
    log.warning(
        "building %s once on this machine (no download; tiny-agent and its kin take a few minutes on two cores) in %s",
        name,
        root,
    )
    started = time.perf_counter()
    try:
        build(tmp)
        log.warning("built %s in %.0f s", name, time.perf_counter() - started)
        (tmp / MARKER_FILE).write_text(json.dumps({"name": name, "builder_version": version}) + "\n")
        try:
            tmp.rename(final)
        except OSError as exc:
            # Another process finished first (the target exists and is non-empty): use theirs.
            if not _is_complete(final, version):
                raise RuntimeError(f"{final} exists but is not a complete model; remove it") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete(path: Path, version: int) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("builder_version") == version


def _sweep_stale_builds(root: Path, name: str) -> None:
    """Remove temp dirs of builds that were killed; a live build is minutes old at most."""
    cutoff = time.time() - _STALE_BUILD_SECONDS
    for leftover in root.glob(f".{name}.tmp-*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue  # a concurrent sweep got there first
