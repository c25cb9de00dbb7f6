"""The GPU attention micro-benchmark: without a GPU it says so and exits cleanly; bad shapes are
refused before anything runs. (What it measures needs a GPU: the device check runs it there.)"""

from __future__ import annotations

import pytest
import torch

from artifact.benchmarks import bench_attention_gpu as bench


def test_without_a_gpu_it_measures_nothing_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--shapes", "1x1024", "32x1024"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("shape,why", [("32", "is not BATCHxCONTEXT"), ("axb", "is not BATCHxCONTEXT"),
                                       ("0x1024", "at least 1")])
def test_bad_shapes_are_refused(shape, why, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--shapes", shape])
    assert exit_info.value.code == 2 and why in capsys.readouterr().err
