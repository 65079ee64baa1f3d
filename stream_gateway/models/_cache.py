"""The build cache: a model directory is built once, in a temp dir renamed into place.

A directory counts as complete only when its marker file, written last, names the builder's
current version (see the package docstring for why). The marker also records the weights' sha256,
so that a directory can be checked against what its build made.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["MARKER_FILE", "default_cache_dir", "recorded_weights_digest", "weights_digest"]

MARKER_FILE = "stream_gateway_model.json"

_STALE_BUILD_SECONDS = 3600.0

log = logging.getLogger("stream_gateway.models")


def default_cache_dir() -> Path:
    """The cache used when a caller passes no ``cache_dir``."""
    return Path.home() / ".cache" / "stream-gateway" / "models"


def _cached_build(
    cache_dir: Path | None,
    name: str,
    version: int,
    build: Callable[[Path], None],
    reference: str | None = None,
) -> Path:
    """Return ``cache_dir/name`` if complete; otherwise build it in a temp dir and rename it there.

    ``reference``: the weights digest the build must give (the registry's ``REFERENCE_WEIGHTS``,
    a shipped file's digest); a build that comes out otherwise is kept, with a warning.
    """
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / name
    if _is_complete(final, version):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_builds(root, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    # Say so, and when it is done: converting smollm2 takes half a minute of silence otherwise.
    log.warning("building %s once on this machine (no download) in %s", name, root)
    started = time.perf_counter()
    try:
        build(tmp)
        log.warning("built %s in %.1f s", name, time.perf_counter() - started)
        digest = weights_digest(tmp)
        if reference is not None and digest != reference:
            log.warning(
                "%s came out unlike its reference (weights sha256 %s, not %s)", name, digest[:16], reference[:16]
            )
        marker = {"name": name, "builder_version": version, "weights_sha256": digest}
        (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n")
        try:
            tmp.rename(final)
        except OSError as exc:
            # Another process finished first (the target exists and is non-empty): use theirs.
            if not _is_complete(final, version):
                raise RuntimeError(f"{final} exists but is not a complete model; remove it") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def weights_digest(path: Path) -> str:
    """The sha256 of a model directory's weights (its ``*.safetensors`` files, by name, concatenated)."""
    hasher = hashlib.sha256()
    for weights in sorted(path.glob("*.safetensors")):
        with weights.open("rb") as f:
            while chunk := f.read(1 << 20):
                hasher.update(chunk)
    return hasher.hexdigest()


def recorded_weights_digest(path: Path) -> str | None:
    """The weights digest a build wrote into its marker (``None``: built before digests were kept)."""
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    digest = marker.get("weights_sha256") if isinstance(marker, dict) else None
    return digest if isinstance(digest, str) else None


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
