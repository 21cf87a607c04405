"""CPU control groups for the real fleet: one group per vLLM instance, a CPU quota as a physical throttle.

Either hierarchy works: cgroup v1's `cpu` controller (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, `cpu.shares`)
or cgroup v2 with the `cpu` controller enabled below the group's parent (`cpu.max`, `cpu.weight`). Every group of
a fleet gets the same share, so instances that contend for the machine's cores contend fairly; a throttled
instance gets a hard quota on top. `detect()` says which hierarchy it found, or why neither is writable.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CgroupUnavailable(RuntimeError):
    """No writable CPU controller: the throttle fault cannot be made physical here."""


@dataclass(frozen=True)
class CpuHierarchy:
    """Where groups are made: `base` is the folder new groups go in, `version` 1 or 2."""

    version: int
    base: Path

    def group(self, name: str) -> CpuGroup:
        """Create (or take over) the group `name` below base, with the fleet's equal share."""
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        g = CpuGroup(self.version, path)
        g.set_quota(None)
        return g


@dataclass(frozen=True)
class CpuGroup:
    """One instance's group."""

    version: int
    path: Path

    def add(self, pid: int) -> None:
        """Move pid into the group (its later children are born in it)."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def set_quota(self, cores: float | None) -> None:
        """At most `cores` CPUs' worth of time per period; None lifts the quota."""
        if cores is not None and not cores > 0:
            raise ValueError(f"a CPU quota must be above 0 cores, not {cores!r}")
        quota = -1 if cores is None else max(1000, round(cores * PERIOD_US))
        if self.version == 1:
            (self.path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        else:
            (self.path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {PERIOD_US}\n")

    def quota(self) -> float | None:
        """The quota in force, in cores; None when there is none."""
        if self.version == 1:
            q = int((self.path / "cpu.cfs_quota_us").read_text())
            period = int((self.path / "cpu.cfs_period_us").read_text())
            return None if q < 0 else q / period
        q, period = (self.path / "cpu.max").read_text().split()
        return None if q == "max" else int(q) / int(period)

    def throttled_us(self) -> int | None:
        """CPU time the quota has withheld so far (cpu.stat), None when the kernel does not say."""
        try:
            stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line)
        except (OSError, ValueError):
            return None
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"])
        return int(stat["throttled_time"]) // 1000 if "throttled_time" in stat else None

    def remove(self, timeout_s: float = 5.0) -> None:
        """Remove the group once it is empty: its killed processes leave it a moment after they die."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY: a process is still in it
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)


def detect(root: Path = ROOT, prefix: str = "grayguard") -> CpuHierarchy:
    """The writable CPU hierarchy: v1's `cpu` controller, else v2 with `cpu` delegable; CgroupUnavailable says
    what was tried and what is needed."""
    tried = []
    v1 = root / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        if os.access(v1, os.W_OK):
            return CpuHierarchy(1, v1 / prefix)
        tried.append(f"cgroup v1 {v1} is not writable")
    else:
        tried.append(f"no cgroup v1 cpu controller at {v1}")
    for v2 in (root, root / "unified"):
        controllers = v2 / "cgroup.controllers"
        if not controllers.exists():
            continue
        if "cpu" not in controllers.read_text().split():
            tried.append(f"cgroup v2 {v2} has no cpu controller")
            continue
        if not os.access(v2, os.W_OK):
            tried.append(f"cgroup v2 {v2} is not writable")
            continue
        base = v2 / prefix
        base.mkdir(exist_ok=True)
        sub = v2 / "cgroup.subtree_control"
        if "cpu" not in sub.read_text().split():
            sub.write_text("+cpu\n")
        bsub = base / "cgroup.subtree_control"
        if bsub.exists() and "cpu" not in bsub.read_text().split():
            bsub.write_text("+cpu\n")
        return CpuHierarchy(2, base)
    raise CgroupUnavailable("no writable CPU cgroup: " + "; ".join(tried) + ". The throttle fault needs root (or a "
                            "delegated cgroup) and cgroup v1's cpu controller or cgroup v2 with cpu enabled")
