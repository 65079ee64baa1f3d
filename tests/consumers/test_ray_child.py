"""tests/support/ray_child.py, the bound on the Ray tests: a hang is killed, with Ray's node, and told.

Real: a spawned child, its Ray node (Ray's own processes), the pipe. A hang is made by a target
that sleeps, a start that hangs by a start deadline shorter than a spawn, and a crashed test
process by SIGKILL to a process running a Ray child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support import ray_child
from ..support.ray_child import call_parent, run_in_ray
from ..support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (by /proc's parent ids)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _hang() -> None:
    """Tell the parent this child's pid, with its Ray node up, then never return."""
    call_parent("up", os.getpid())
    time.sleep(3600)


def _fail() -> None:
    raise ValueError("the target's own failure")


def _ask_then_fail() -> None:
    """Ask the parent a question, then fail with its answer in the message."""
    raise ValueError(f"the target's own failure, after the parent's {call_parent('double', 21)}")


def test_a_target_that_hangs_is_killed_with_its_ray_node_and_the_failure_quotes_rays_logs() -> None:
    node: set[int] = set()

    def up(pid: int) -> None:
        node.update(_descendants(pid) | {pid})

    with pytest.raises(AssertionError, match=r"ran past 5 s: killed") as failure:
        run_in_ray(_hang, num_cpus=1, namespace="hang", pythonpath=ROOT, timeout=5, calls={"up": up})
    assert len(node) >= 3  # the child, and Ray's GCS and raylet at least
    wait_until(lambda: not any(_alive(pid) for pid in node), timeout=30, what="the child and its Ray node gone")
    assert "--- raylet.out" in str(failure.value) and "--- gcs_server.out" in str(failure.value)


def test_a_target_that_raises_fails_with_its_traceback_after_a_call_is_answered() -> None:
    calls = {"double": lambda n: 2 * n}
    with pytest.raises(
        AssertionError, match=r"(?s)target failed:.*ValueError: the target's own failure, after the parent's 42"
    ):
        run_in_ray(_ask_then_fail, num_cpus=1, namespace="fail", pythonpath=ROOT, timeout=60, calls=calls)


def _report_then_wait(report: str) -> None:
    """A test's process in miniature: a Ray child that hangs, its processes written to ``report``."""

    def up(pid: int) -> None:
        Path(report).write_text(" ".join(str(p) for p in _descendants(pid) | {pid}))

    run_in_ray(_hang, num_cpus=1, namespace="orphan", pythonpath=ROOT, timeout=600, calls={"up": up})


def test_a_test_process_that_dies_takes_its_ray_child_and_node_with_it(tmp_path: Path) -> None:
    report = tmp_path / "pids"
    code = f"from tests.consumers.test_ray_child import _report_then_wait; _report_then_wait({str(report)!r})"
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        wait_until(report.exists, timeout=120, what="the Ray child's processes reported")
        node = {int(pid) for pid in report.read_text().split()}
        assert len(node) >= 3  # the child, and Ray's GCS and raylet at least
        process.kill()  # as a crashed pytest worker dies: no finally runs
        process.wait(30)
        wait_until(lambda: not any(_alive(pid) for pid in node), timeout=30, what="the orphaned Ray child gone")
    finally:
        process.kill()
        process.wait(30)


def test_a_start_that_hangs_is_made_once_more_then_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_child, "START_S", 0.3)  # shorter than a spawn: every start "hangs"
    spawned: list[str] = []
    spawn = ray_child.RayChild._spawn

    def counted(self: ray_child.RayChild) -> None:
        spawned.append(self.namespace)
        spawn(self)

    monkeypatch.setattr(ray_child.RayChild, "_spawn", counted)
    with pytest.raises(AssertionError, match=r"did not start in 0 s, twice"):
        run_in_ray(_fail, num_cpus=1, namespace="slow", pythonpath=ROOT, timeout=60)
    assert spawned == ["slow", "slow"]
