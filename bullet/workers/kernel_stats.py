"""What a GPU worker says about its kernels beside its steps: Triton compiles after its start-up
warm-up (the goal is none: a compile stalls the served step that launches it) and kernels it fell back from
(a fused or MoE Triton kernel that failed on this GPU, served on torch lines from then on).

Each timeline row carries them once they are non-zero (`timeline_fields`): `triton_compiles`, the
compiles since the worker became ready, and `kernel_fallbacks`, one line per kernel given up
("kernel -> what runs instead: why"). `artifact.served_kernels` reads them back per served system."""

from __future__ import annotations

import logging

from engines import kernel_fallbacks
from engines.kernel_warmup import warm_kernels
from engines.runner import ModelRunner
from engines.triton_compiles import COUNTER

log = logging.getLogger("bullet.workers.kernels")


def timeline_fields() -> dict:
    """The fields a timeline row adds (nothing while nothing happened)."""
    out: dict = {}
    compiles = COUNTER.serving
    if compiles:
        out["triton_compiles"] = compiles
    gave_up = kernel_fallbacks.fallbacks()
    if gave_up:
        out["kernel_fallbacks"] = [f"{r['kernel']} -> {r['instead']}: {r['error'][:160]}" for r in gave_up]
    return out


def warm(runner: ModelRunner, scratch_page: int) -> None:
    """Every Triton variant a GPU worker's steps can launch, compiled before it reports ready
    (`engines.kernel_warmup`, on the caller's stream)."""
    if runner.device.type != "cuda":
        return
    report = warm_kernels(runner, scratch_page)
    snap = COUNTER.snapshot()
    log.info("kernels warmed: %d steps in %.2f s, %d Triton compiles so far%s", len(report.steps), report.seconds,
             snap["total"], "" if snap["installed"] else " (compile counter not installed)")


def serving_starts() -> None:
    """From now on (the worker's last start-up step: graphs captured too) compiles count as while
    serving."""
    COUNTER.mark_serving()
