"""The build cache: a model directory is built once, in a temp dir renamed into place.

A directory counts as complete only when its marker file, written last, names the builder's
current version (see the package docstring for why).

A named model is built in a child process whose float code paths are pinned (``PINNED_NUMERICS``),
so that its bytes do not depend on the machine's CPU. Unpinned, the same seeded recipe gave a
different tiny-agent on each x86 machine it met (AVX2 and AVX-512 ones): torch picks its
kernels by the CPU's widest vector unit, and MKL picks its matrix products by the CPU's vendor and
model, and training amplifies the last-bit differences into different weights (and, at the
recipes' margins, different answers). Pinned, torch runs its AVX2 kernels (the same instructions
give the same bits on every CPU that has them) and MKL its ``COMPATIBLE`` branch, the one branch
MKL keeps alike across vendors (its other branches fall back to the CPU's own dispatch on AMD).
The price: a fine-tune takes about twice as long (measured on tiny-agent's first steps, 4.1 s
unpinned against 7.7-8.5 s pinned, AMD EPYC with AVX2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "MARKER_FILE",
    "PINNED_NUMERICS",
    "build_numerics",
    "default_cache_dir",
    "recorded_weights_digest",
    "weights_digest",
]

MARKER_FILE = "stream_gateway_model.json"

# The environment of a build's child process. Each variable is read once, when torch or MKL starts,
# so it cannot be set from inside a process that has already run a tensor operation.
PINNED_NUMERICS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's kernels: AVX2, even where AVX-512 is there
    "MKL_CBWR": "COMPATIBLE,STRICT",  # MKL's SSE2 branch, alike on Intel and AMD, alignment-blind
    "DNNL_MAX_CPU_ISA": "AVX2",  # oneDNN (the build also turns it off: see _pinned_build)
    "OMP_NUM_THREADS": "2",  # the recipes train on two threads (reductions split by thread count)
    "MKL_NUM_THREADS": "2",
}
# Set in the child: it builds in-process rather than starting another child.
_PINNED_CHILD = "STREAM_GATEWAY_PINNED_BUILD"

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
    spec: str | None = None,
) -> Path:
    """Return ``cache_dir/name`` if complete; otherwise build it in a temp dir and rename it there.

    ``reference``: the weights digest of the reference build (the registry's ``REFERENCE_WEIGHTS``);
    a build that comes out otherwise is kept, with a warning that this machine's numerics differ.
    ``spec``: the model's name for ``resolve_model``; given, the build runs in a child process with
    ``PINNED_NUMERICS`` (the child resolves ``spec`` and lands here again, building in-process).
    """
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / name
    if _is_complete(final, version):
        return final
    root.mkdir(parents=True, exist_ok=True)
    if spec is not None and os.environ.get(_PINNED_CHILD) != "1":
        _build_in_pinned_child(spec, root)
        if not _is_complete(final, version):
            raise RuntimeError(f"the build of {spec} finished without a complete {final}")
        return final
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
        digest = weights_digest(tmp)
        if reference is not None and digest != reference:
            log.warning(
                "%s came out unlike the reference build (weights sha256 %s, not %s): this machine's float "
                "kernels differ, and its answers may differ from what the tests and docs expect",
                name,
                digest[:16],
                reference[:16],
            )
        marker = {"name": name, "builder_version": version, "weights_sha256": digest, "numerics": build_numerics()}
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


def _build_in_pinned_child(spec: str, root: Path) -> None:
    """Build ``spec`` into ``root`` in a child process with ``PINNED_NUMERICS``; its log goes to ours."""
    env = {**os.environ, **PINNED_NUMERICS, _PINNED_CHILD: "1"}
    command = [sys.executable, "-m", "stream_gateway.models._pinned_build", spec, str(root)]
    done = subprocess.run(command, env=env, check=False, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"building {spec} failed (exit {done.returncode}; its log is above)")


def build_numerics() -> dict[str, str | None]:
    """The float code paths this process builds on, as its marker records them."""
    torch = sys.modules.get("torch")  # every build that trains has imported it; others need not
    return {
        "torch": getattr(torch, "__version__", None),
        "cpu_capability": torch.backends.cpu.get_cpu_capability() if torch is not None else None,
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "threads": str(torch.get_num_threads()) if torch is not None else None,
    }


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
