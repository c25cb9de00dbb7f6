"""Compute partition backends: how a worker's share of the accelerator is enforced.

    backend = make_backend("cpu", role="decode")
    backend.apply(1)            # between steps
    backend.current_units, backend.unit_set(), backend.apply_costs()

| name        | device | mechanism                                                            |
|-------------|--------|----------------------------------------------------------------------|
| `cpu`       | CPU    | every thread pinned to a core set + matching torch thread count      |
| `libsmctrl` | NVIDIA | TPC disable-mask on the worker's stream via a user-built libsmctrl.so |
| `green-ctx` | NVIDIA | pool of green-context streams, one per SM count (official CUDA API)   |
| `mps-percentage` | NVIDIA | MPS's per-client SM cap, fixed when the worker starts (coarse) |
| `none`      | any    | no partition: the naive concurrent baseline                           |

Backends whose module needs CUDA pieces are imported only when asked for."""

from __future__ import annotations

import importlib

from bullet.partition.base import (
    ROLES,
    Granularity,
    PartitionBackend,
    PartitionUnavailable,
    format_id_list,
    parse_id_list,
    role_slice,
)
from bullet.partition.stats import ApplyCostSummary

# name -> (module, class)
BACKENDS = {
    "cpu": ("bullet.partition.cpu", "CpuCoreBackend"),
    "libsmctrl": ("bullet.partition.libsmctrl", "LibSmCtrlBackend"),
    "green-ctx": ("bullet.partition.green_ctx", "GreenContextBackend"),
    "mps-percentage": ("bullet.partition.mps_share", "MpsPercentageBackend"),
    "none": ("bullet.partition.unpartitioned", "NoPartitionBackend"),
}


def make_backend(name: str, role: str, **opts) -> PartitionBackend:
    """Build backend `name` for a worker of `role` ("prefill" or "decode"). Options are the
    backend's constructor keywords (e.g. `cores=` for cpu, `stream=`/`library=` for libsmctrl,
    `device=`/`counts=` for green-ctx, `total_units=` for none). Raises PartitionUnavailable with
    the reason when the backend cannot work on this machine."""
    try:
        module_name, class_name = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown partition backend {name!r}; choose from {', '.join(BACKENDS)}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(role, **opts)


__all__ = ["BACKENDS", "ROLES", "ApplyCostSummary", "Granularity", "PartitionBackend",
           "PartitionUnavailable", "format_id_list", "make_backend", "parse_id_list", "role_slice"]
