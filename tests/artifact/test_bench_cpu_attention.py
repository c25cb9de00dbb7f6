"""The CPU attention benchmark on a tiny run: every side timed for every step, the prompt cut in two
gives the whole prompt's logits through the kernel, another build (this tree's own, loaded a second
time) is timed beside it and put back, and the table is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifact.benchmarks import bench_cpu_attention, common
from engines.model import cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention._ext is None or cpu_attention.kernel_isa() == cpu_attention.ISA_GENERIC,
                                reason="the int8 model pages through the C attention kernel only where it has vector code")


def test_a_tiny_run_times_every_side_and_the_kernels_prompt_is_cut_invariant(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    own = cpu_attention._ext
    so = Path(own.__file__)  # <tree>/engines/_cpu_attention*.so
    rows = bench_cpu_attention.main(["--prompts", "40", "--batches", "2", "--context", "30", "--rounds", "1",
                                     "--against", str(so.parent.parent), "--name", "attn"])
    assert cpu_attention._ext is own and "attends_prompts" not in vars(cpu_attention.CpuPagedKernels())
    prefill, decode = rows
    assert [prefill["step"], decode["step"]] == ["prefill_40", "decode_2"]
    for r in rows:
        assert all(r[f"{n}_ms"] > 0 for n in ("kernel", "sdpa", "against"))
        assert r["sdpa_over_kernel"] == r["sdpa_ms"] / r["kernel_ms"]
    assert prefill["kernel_cut_difference"] == 0.0 and prefill["sdpa_cut_difference"] >= 0.0
    assert "kernel_cut_difference" not in decode
    table = (tmp_path / "attn.md").read_text()
    assert "| 1 | prefill_40 |" in table and "other / kernel" in table
    with pytest.raises(RuntimeError, match="decode rows only"):
        bench_cpu_attention.OlderAttention(own).decode(*[0] * 20, True)
