"""The engine benchmark keeps what it measured when it is cut short: its JSON is rewritten after
every section, so a run killed in the middle (a time cap, SIGKILL) leaves each finished section,
the goals judged on them and its kernels' state (warm-up, Triton compiles, fallbacks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the real benchmark on the CPU with tiny sizes, killed (SIGKILL: no handler, no cleanup) the
# moment it starts the mixed-steps section
KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from artifact.benchmarks import bench_engine_gpu as bench

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    bench.mixed_steps = killed
    sys.exit(bench.main(sys.argv[1:]))
""")
TINY = ["--device", "cpu", "--load-format", "dummy", "--dtype", "float32", "--threads", "1", "--repeats", "1",
        "--prefill-tokens", "8", "--decode", "1x8,2x8", "--mixed", "4+1x8"]
# a two-layer Llama: the sections, not the model, are under test
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}


def test_a_killed_run_leaves_the_sections_it_finished(tmp_path):
    out, config = tmp_path / "engine.json", tmp_path / "tiny.json"
    config.write_text(json.dumps(CONFIG))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", KILLED_RUN, *TINY, "--model-path", str(config), "--output", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stdout[-2000:] + done.stderr[-2000:]  # killed, as a cap kills it
    data = json.loads(out.read_text())  # whole: every write replaced the file at once
    assert data["complete"] is False
    assert data["sections_done"] == ["rates", "warm_up", "prefill", "new_lengths", "decode"]
    assert data["rates"]["copy_gbs"] > 0 and data["prefill"]["tokens"] == 8 and data["prefill"]["ms"] > 0
    assert [(r["batch"], r["graphs"]) for r in data["decode"]] == [(1, "off"), (1, "on"), (2, "off"), (2, "on")]
    assert "mixed" not in data and "fused" not in data  # the sections it never finished: absent, not empty
    assert data["goals"] == []  # judged on what it has (none at these sizes), not failed on what it lacks
    kernels = data["kernels"]
    assert kernels["warm_up"]["steps"] >= 9 and kernels["fallbacks"] == []
    assert kernels["triton_compiles"]["after_warm_up"] == 0
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left beside it
