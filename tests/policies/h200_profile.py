"""The GPU profile `bullet launch --policy bullet` measured on an NVIDIA H200 (132 SMs), driver 13.0,
green-ctx backend, MPS on, 2026-11-26 (dummy Llama-3.1-8B, bf16, decode steps timed eagerly): GEMM and
copy rates per share and the end-to-end steps, alone and beside the other phase. The kernel sweeps of
that profile were printed only as sums, so this estimator is calibrated on the steps alone — close to,
not the same as, the one that server used."""

from __future__ import annotations

from engines.model_config import ModelConfig
from estimator.calibration import Sample
from estimator.profiler.cuda_probe import gpu_hardware
from estimator.profiler.fit import build_estimator

RATES = {24: (166e12, 1771e9), 40: (270e12, 2689e9), 72: (480e12, 3757e9), 132: (793e12, 4203e9)}  # FLOP/s, B/s
SHARES = (24, 40, 72, 132)
PREFILL_MS = {  # (prompt lengths, layers or None = all): ms on 24, 40, 72, 132 SMs
    ((512,), None): (69.29, 45.69, 28.09, 19.09),
    ((2048,), None): (271.38, 172.72, 99.61, 64.70),
    ((512, 512, 512, 512), None): (266.72, 170.47, 98.43, 64.07),
    ((2048,), 4): (34.13, 21.75, 12.46, 7.82),
}
DECODE_MS = {  # (batch, context per request): ms on 24, 40, 72, 132 SMs — flat: launch-bound eager steps
    (1, 1024): (19.28, 19.22, 19.76, 25.69),
    (8, 2048): (42.18, 42.23, 42.44, 41.49),
    (32, 1024): (71.18, 66.78, 76.67, 72.43),
    (128, 512): (139.77, 107.10, 112.08, 124.61),
}
DECODE_BESIDE_PREFILL_MS = {  # (decode SMs, batch, context, prefill tokens beside it): ms
    (40, 32, 1024, 512): 71.81, (40, 128, 512, 512): 129.11, (40, 32, 1024, 2048): 74.22,
    (40, 128, 512, 2048): 134.20, (72, 32, 1024, 512): 65.02, (72, 128, 512, 512): 114.76,
    (72, 32, 1024, 2048): 64.80, (72, 128, 512, 2048): 112.85,
}
PREFILL_BESIDE_DECODE_MS = {  # (prefill SMs, layers or None, decode batch beside it): ms of prefill[2048]
    (88, None, 32): 94.42, (88, 4, 32): 11.79, (88, None, 128): 93.74, (88, 4, 128): 11.65,
    (56, None, 32): 138.28, (56, 4, 32): 17.27, (56, None, 128): 136.73, (56, 4, 128): 17.28,
}


def samples() -> list[Sample]:
    out = []
    for (lens, layers), times in PREFILL_MS.items():
        out += [Sample(kind="prefill", units=u, seconds=ms / 1e3, prefill_lens=lens, num_layers=layers,
                       include_head=layers is None) for u, ms in zip(SHARES, times)]
    for (batch, ctx), times in DECODE_MS.items():
        out += [Sample(kind="decode", units=u, seconds=ms / 1e3, decode_batch=batch, decode_context=batch * ctx)
                for u, ms in zip(SHARES, times)]
    for (u, batch, ctx, tokens), ms in DECODE_BESIDE_PREFILL_MS.items():
        out.append(Sample(kind="decode", units=u, seconds=ms / 1e3, decode_batch=batch, decode_context=batch * ctx,
                          co_running=tokens))
    for (u, layers, batch), ms in PREFILL_BESIDE_DECODE_MS.items():
        out.append(Sample(kind="prefill", units=u, seconds=ms / 1e3, prefill_lens=(2048,), num_layers=layers,
                          include_head=layers is None, co_running=batch))
    return out


def h200_estimator():
    hardware = gpu_hardware("NVIDIA H200", 132, "bf16", {u: f for u, (f, _) in RATES.items()},
                            {u: b for u, (_, b) in RATES.items()}, min_partition=8, partition_step=8,
                            backend="green-ctx")
    return build_estimator(ModelConfig.builtin("llama-3.1-8b"), hardware, "bf16", samples())
