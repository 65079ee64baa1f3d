"""docs/architecture.md names every module of the four packages, and only modules that exist.

The rule the page follows (stated in its introduction):

* every ``.py`` path written anywhere on the page is a path from the repository root to a file
  that exists (``stream_gateway/engines/remote/_vllm.py``, ``scripts/import_graph.py``): a bare
  ``_vllm.py``, a ``_<name>.py`` placeholder or a renamed module fails;
* every ``.py`` file under ``stream_gateway/``, ``pipeline/``, ``consumers/`` and ``stream_stack/``
  (``__init__.py`` and ``__main__.py`` included) has exactly one line in "The rooms, module by
  module": a list item starting with its path in backticks, under the ``###`` heading of its own
  folder (the heading's first backticked token, ``stream_gateway/engines/remote/``);
* every ``.py`` file under ``model_recipes/`` (outside the product) has its line in a section of its own.

Pure file reading: nothing of the packages is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("stream_gateway", "pipeline", "consumers", "stream_stack")
CATALOG = "## The rooms, module by module"

# A path-like token ending in .py: everything up to the nearest space or markdown delimiter.
PY_TOKEN = re.compile(r"[^\s`*()\[\]|,;:'\"]*\.py(?!\w)")
ROOM_HEADING = re.compile(r"^### `([^`]+/)`")
ENTRY = re.compile(r"^- `([^`]+\.py)`")


def _modules() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def _catalog() -> list[tuple[int, str | None, str]]:
    """``(line number, room heading or None, path)`` for each entry of the rooms section."""
    lines = DOC.read_text().splitlines()
    start = lines.index(CATALOG)  # ValueError names the missing heading
    entries: list[tuple[int, str | None, str]] = []
    room: str | None = None
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        if line.startswith("### "):
            heading = ROOM_HEADING.match(line)
            room = heading.group(1) if heading else None
        elif entry := ENTRY.match(line):
            entries.append((number, room, entry.group(1)))
    return entries


def test_every_py_path_in_the_doc_exists() -> None:
    unknown = sorted(
        f"line {number}: {token}"
        for number, line in enumerate(DOC.read_text().splitlines(), 1)
        for token in PY_TOKEN.findall(line)
        if not (ROOT / token).is_file() or token.startswith(("/", "."))
    )
    assert not unknown, (
        "docs/architecture.md names .py files that do not exist (write each as its path from the "
        "repository root; a renamed or deleted module needs its line changed):\n  " + "\n  ".join(unknown)
    )


def test_every_module_has_its_line_under_its_room() -> None:
    entries = _catalog()
    named = [path for _, _, path in entries]
    missing = sorted(_modules() - set(named))
    assert not missing, (
        f"modules with no line in docs/architecture.md's {CATALOG!r} (add one under the module's room: "
        "- `path`: what it owns):\n  " + "\n  ".join(missing)
    )
    duplicated = sorted({path for path in named if named.count(path) > 1})
    assert not duplicated, "modules with more than one line in the rooms:\n  " + "\n  ".join(duplicated)
    misplaced = sorted(
        f"line {number}: {path} is under {room or 'no room heading'}, not {path.rsplit('/', 1)[0]}/"
        for number, room, path in entries
        if room != path.rsplit("/", 1)[0] + "/"
    )
    assert not misplaced, "module lines under the wrong room:\n  " + "\n  ".join(misplaced)


def test_the_rooms_name_only_modules_of_the_packages() -> None:
    foreign = sorted(f"line {number}: {path}" for number, _, path in _catalog() if path not in _modules())
    assert not foreign, (
        f"lines in the rooms for files that are not modules of {', '.join(PACKAGES)}:\n  " + "\n  ".join(foreign)
    )


RECIPES_SECTION = "## Outside the product: `model_recipes/`"


def test_every_model_recipes_module_has_its_line_in_its_own_section() -> None:
    lines = DOC.read_text().splitlines()
    start = lines.index(RECIPES_SECTION)  # ValueError names the missing heading
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    named = [entry.group(1) for line in lines[start + 1 : end] if (entry := ENTRY.match(line))]
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "model_recipes").rglob("*.py")}
    assert sorted(named) == sorted(modules), "docs/architecture.md's model_recipes section lists other modules"
