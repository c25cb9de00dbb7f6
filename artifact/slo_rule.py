"""SLOs for a machine other than the paper's: scale Bullet's Table 4 targets by how much slower this
device runs the served model solo than an A100 runs Llama-3-8B.

    TTFT/token here = Table-4 TTFT/token x (solo prefill time per token here / on the A100)
    TPOT here       = Table-4 TPOT       x (solo batch-1 decode step here / on the A100)

A100 solo latencies are the measured ones of ../shared/reference/numbers.md (Llama-3-8B, bf16):
prefill of 1024 tokens 78.7 ms, decode step at batch 1 with a 1024-token context 10.5 ms. The local
solo latencies come from the estimator profile of this machine (all units, no co-running phase)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet.types.slo import SLO

A100_PREFILL_S_PER_TOKEN = 78.7e-3 / 1024
A100_DECODE_STEP_S = 10.5e-3
TABLE4 = {  # normalized TTFT (s per input token), TPOT (s)
    "sharegpt": (3.0e-3, 150e-3),
    "azure-code": (1.5e-3, 200e-3),
    "arxiv-sum": (1.5e-3, 175e-3),
}


@dataclass
class DerivedSLO:
    slo: SLO
    solo_prefill_s_per_token: float
    solo_decode_step_s: float
    ttft_scale: float
    tpot_scale: float
    rule: str

    def as_dict(self) -> dict:
        return {"ttft_s_per_token": self.slo.ttft, "tpot_s": self.slo.tpot,
                "solo_prefill_s_per_token": self.solo_prefill_s_per_token,
                "solo_decode_step_s": self.solo_decode_step_s, "ttft_scale": self.ttft_scale,
                "tpot_scale": self.tpot_scale, "rule": self.rule}


def server_slo_flags(ttft_s_per_token: float, tpot_s: float) -> tuple[str, str]:
    """The `--ttft-slo` and `--tpot-slo` values a served comparison starts its servers with: a replay of
    that comparison gives its simulated policies the same two strings, so both decide on the same targets."""
    return f"{ttft_s_per_token * 1e3:.4f}ms/token", f"{tpot_s * 1e3:.2f}ms"


def derive_slo(estimator, typical_prompt: int, workload: str = "sharegpt", typical_context: int = 1024) -> DerivedSLO:
    units = estimator.hardware.units
    prefill = estimator.prefill_time([typical_prompt], units) / typical_prompt
    decode = estimator.decode_time(1, typical_context, units)
    ttft0, tpot0 = TABLE4[workload]
    ts, ds = prefill / A100_PREFILL_S_PER_TOKEN, decode / A100_DECODE_STEP_S
    slo = SLO(ttft=ttft0 * ts, ttft_per_token=True, tpot=tpot0 * ds)
    rule = (f"Table 4 ({workload}: {ttft0 * 1e3:g} ms/token, {tpot0 * 1e3:g} ms) scaled by the solo-latency ratio "
            f"to an A100 (prefill x{ts:.1f}, decode x{ds:.1f}) = {slo.describe()}")
    return DerivedSLO(slo, prefill, decode, ts, ds, rule)
