"""`build_model` puts a model around weights that already exist (shared memory, CUDA IPC): it builds the
modules on the meta device and assigns the tensors. Nothing there may initialise a meta tensor through
`torch._refs`, whose first use imports torch._dynamo — ~1.5 s of every worker's start on 2 cores, paid
again at every restart — and the RoPE tables must still end up on the model's device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, torch
from engines.model_config import ModelConfig
from engines.model.build import build_model, float_shapes
for hf in (dict(model_type="llama", architectures=["LlamaForCausalLM"]),
           dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"])):
    cfg = ModelConfig.from_hf_dict({**hf, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                    "vocab_size": 256, "max_position_embeddings": 512,
                                    "tie_word_embeddings": True}, name="tiny")
    state = {name: torch.randn(shape) for name, shape in float_shapes(cfg).items()}
    model = build_model(cfg, state)
    assert model.embed_tokens.weight.data_ptr() == state["embed_tokens.weight"].data_ptr()  # assigned, not copied
    assert model.rope is not None and all(b.device.type == "cpu" for b in model.rope.buffers())
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules}))
"""


def test_building_a_model_around_its_weights_never_imports_dynamo():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"dynamo": False}
