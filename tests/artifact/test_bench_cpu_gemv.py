"""The few-row kernel benchmark on small sizes, through its real kernel, model and runner: every
(dtype, shape, rows) projection and every decode batch has both sides' times and their ratio, the
kernel's row limit is put back after the decode part turned it off, and the JSON and markdown are
written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from artifact.benchmarks import bench_cpu_gemv, common
from engines.model import cpu_gemv

pytestmark = pytest.mark.skipif(cpu_gemv._ext is None, reason="engines._cpu_gemv is not built")
ARGS = ["--threads", "1", "--rows", "1", "3", "--shapes", "smollm2 o", "smollm2 down", "--batches", "1",
        "--repeats", "1", "--name", "gemv-tiny"]


def test_tiny_run_writes_every_projection_and_decode_step(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    threads, limit = torch.get_num_threads(), cpu_gemv.LINEAR_ROWS
    rows = bench_cpu_gemv.main(ARGS)
    assert torch.get_num_threads() == threads and cpu_gemv.LINEAR_ROWS == limit  # both put back
    data = json.loads((tmp_path / "gemv-tiny.json").read_text())
    assert data["results"] == json.loads(json.dumps(rows)) and isinstance(data["cpu_flags"], list)
    proj = [r for r in rows if r["part"] == "projection"]
    assert [(r["dtype"], r["shape"], r["rows"]) for r in proj] == [
        (d, s, n) for d in ("bfloat16", "float32") for s in ("smollm2 o", "smollm2 down") for n in (1, 3)]
    for r in proj:
        assert r["torch_ms"] > 0 and r["kernel_ms"] > 0 and r["speedup"] == r["torch_ms"] / r["kernel_ms"]
        n, k = bench_cpu_gemv.SHAPES[r["shape"]]
        assert r["kernel_gbs"] == pytest.approx(n * k * (2 if r["dtype"] == "bfloat16" else 4) / r["kernel_ms"] / 1e6)
    (dec,) = [r for r in rows if r["part"] == "decode"]
    assert dec["batch"] == 1 and dec["bf16_kernel_ms"] > 0 and dec["bf16_torch_ms"] > 0 and dec["fp32_ms"] > 0
    assert dec["bf16_rowwise_ms"] > 0 and dec["weights_first_gain"] == dec["bf16_rowwise_ms"] / dec["bf16_kernel_ms"]
    table = (tmp_path / "gemv-tiny.md").read_text()
    assert table.count("| smollm2 ") == len(proj) and "| 1 | 1 |" in table


def test_another_build_is_timed_beside_this_one_and_put_back(tmp_path, monkeypatch):
    """`--against` loads another build of the kernel (here this tree's own .so, loaded a second time:
    a module of its own) and times it in the same rounds; `--cold-mb` cycles the weights through
    copies. The tree's own build is in place again afterwards."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    so = Path(cpu_gemv._ext.__file__)  # <tree>/engines/_cpu_gemv*.so
    other = common.load_kernel_build(so)
    assert other is not cpu_gemv._ext and other.best_isa() == cpu_gemv._ext.best_isa()
    own = cpu_gemv._ext
    with common.kernel_build(other):
        assert cpu_gemv._ext is other
        x, w = torch.randn(1, 576).to(torch.bfloat16), torch.randn(576, 576).to(torch.bfloat16)
        swapped = cpu_gemv.linear(x, w)
    assert cpu_gemv._ext is own and torch.equal(swapped, cpu_gemv.linear(x, w))
    rows = bench_cpu_gemv.main(["--threads", "1", "--rows", "1", "--shapes", "smollm2 o", "--dtype", "bfloat16",
                                "--no-decode", "--repeats", "1", "--cold-mb", "2", "--against", str(so.parent.parent),
                                "--name", "gemv-against"])
    assert cpu_gemv._ext is own
    (r,) = rows
    assert r["weight_copies"] == 4  # 0.63 MiB each: four cover 2 MiB
    assert r["against_ms"] > 0 and r["kernel_over_against"] == r["against_ms"] / r["kernel_ms"]
    assert "this build ÷ other" in (tmp_path / "gemv-against.md").read_text()
    with pytest.raises(SystemExit, match="no engines/_cpu_gemv"):
        common.load_kernel_build(tmp_path)
