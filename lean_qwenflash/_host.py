"""Facts about the host this process runs on, read with the standard library only.

The package's own ``__init__`` reads the CPU quota before torch can be imported (it picks torch's
OpenMP spin), so this module sits below every layer: it imports nothing of ours, and importing any
module of the package loads it (``tests/test_layering.py`` lets every layer load private modules).
"""
from __future__ import annotations

from typing import Optional


def cgroup_dirs(controller: str, root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> list:
    """The cgroup directories whose limits bind this process for ``controller`` ("memory",
    "cpu"), innermost first: its own group (``proc``: /proc/self/cgroup) and each parent, in that
    controller's v1 hierarchy (``root/<controller,...>``) and in the unified v2 one (``root``, or
    ``root/unified`` on a hybrid mount), then the mount roots themselves. Only directories that
    exist. (A process in a nested group, e.g. a systemd slice or a benchmark's capped group, is
    limited there, not at the root.)"""
    from pathlib import Path
    base = Path(root)
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, rel = fields
        if controllers == "":
            hierarchy = base if (base / "cgroup.controllers").exists() else base / "unified"
        elif controller in controllers.split(","):
            hierarchy = base / controllers
        else:
            continue
        names = [n for n in rel.strip("/").split("/") if n and n != ".."]
        found += [hierarchy.joinpath(*names[:i]) for i in range(len(names), -1, -1)]
    found += [base, base / controller]
    out = []
    for d in found:
        if d.is_dir() and d not in out:
            out.append(d)
    return out


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroups in cores, the tightest of its group and its parents
    (``cgroup_dirs``; v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``);
    None when there is none or it cannot be read."""
    limits = []
    for d in cgroup_dirs("cpu", root, proc):
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max":
                limits.append(int(quota) / int(period))
            continue
        except (OSError, ValueError):
            pass
        try:
            quota, period = int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
            if quota > 0 and period > 0:
                limits.append(quota / period)
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None
