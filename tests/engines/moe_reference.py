"""The mixture-of-experts SwiGLU experts by their definition, in float64, one token and pick at a time:
what the CPU kernels' tests (test_cpu_gemv.py, test_cpu_amx.py) compare against."""

from __future__ import annotations

import torch


def experts_definition(x, weights, ids, gate_up, down) -> torch.Tensor:
    """x [T, H], weights/ids [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] float64: sum over the
    picks of weight x down @ (silu(gate @ x) * (up @ x))."""
    width = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = gate_up[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (down[e].double() @ (torch.nn.functional.silu(h[:width]) * h[width:]))
    return out
