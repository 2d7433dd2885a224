"""Pieces the benchmark scripts share: running a measurement in its own process (optionally inside
a cgroup v1 memory limit), and recording which experts a model's routers pick."""
from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup/memory")


def can_limit_memory() -> bool:
    return os.geteuid() == 0 and CGROUP.is_dir()


def drop_page_cache() -> None:
    """Start a run cold: page cache filled by an earlier run (charged to another cgroup) would
    let a limited run read a file it never pays for."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def evict_page_cache(path) -> None:
    """Drop ``path``'s pages from the page cache (after writing back), so the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_json_worker(cmd: list, limit_bytes: int | None = None, name: str = "lqf-bench", env: dict | None = None) -> dict:
    """Run ``cmd`` (a worker printing one JSON line last) and return that JSON; inside a cgroup
    limited to ``limit_bytes`` (page cache counted) when given, with its peak usage and how
    often the limit forced reclaim. A failed worker gives {"error", "returncode"}."""
    group = None
    if limit_bytes:
        group = CGROUP / f"{name}-{os.getpid()}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        # The shell joins the group, then becomes the worker: everything it allocates is counted.
        cmd = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"] + list(cmd)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            return {"error": (p.stderr or "")[-1500:] or
                    f"exit status {p.returncode} (killed by the cgroup's OOM killer?)", "returncode": p.returncode}
        res = json.loads(p.stdout.strip().splitlines()[-1])
        if group:
            res["cgroup_peak_bytes"] = int((group / "memory.max_usage_in_bytes").read_text())
            res["cgroup_limit_bytes"] = limit_bytes
            res["limit_hits"] = int((group / "memory.failcnt").read_text())  # reclaim at the limit, not kills
        return res
    finally:
        if group:
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


@contextmanager
def recorded_routing(model):
    """Inside the block, every one-token step's top-k choice per MoE layer is counted; yields
    the {layer: {expert: picks}} dict (hooks cost ~15% of a step: keep them out of timings)."""
    import torch
    routed: dict = {}

    def hook(block, args, output):
        flat = args[0].reshape(-1, args[0].shape[-1])
        if flat.shape[0] == 1:
            probs = torch.softmax(block.gate(flat).float(), -1)
            for e in torch.topk(probs, block.top_k).indices[0].tolist():
                per = routed.setdefault(block.layer_idx, {})
                per[e] = per.get(e, 0) + 1
    handles = [b.register_forward_hook(hook) for b in model.moe_blocks()]
    try:
        yield routed
    finally:
        for h in handles:
            h.remove()


def routing_summary(routed: dict) -> dict:
    """Distinct experts per layer (mean over layers) and the busiest expert's share of picks (max
    over layers; 1/top_k: picked for every token)."""
    distinct = [len(v) for v in routed.values()]
    shares = [max(v.values()) / sum(v.values()) for v in routed.values()]
    return {"distinct_experts_per_layer": sum(distinct) / max(1, len(distinct)),
            "top_expert_share": max(shares, default=float("nan"))}
