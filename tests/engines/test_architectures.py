"""Qwen2 and Qwen3 on tiny random checkpoints `transformers` saved itself: greedy tokens equal
transformers' through a real server; the other execution paths (bf16, the fused Triton stages, the
paged kernels, int8) agree with the fp32 reference; and every checkpoint tensor finds its place in
the model or the load fails naming it. (Every architecture's logits against transformers' —
prefill, paged decode, a prefix-cache hit, the offline engine: `test_transformers_equivalence`.)"""

from __future__ import annotations

import json

import pytest
import torch

from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.model_config import ModelConfig
from engines.runner import ModelRunner, SeqChunk
from engines.weights import ModelLoadError, load_weights
from tests.engines import tiny_checkpoints as tiny

transformers = pytest.importorskip("transformers")

QWEN2, QWEN3 = "Qwen2ForCausalLM", "Qwen3ForCausalLM"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village at the edge"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """architecture -> (directory, transformers' model), saved once per module."""
    return {arch: (path, tiny.save(arch, path))
            for arch in (QWEN2, QWEN3) for path in [tmp_path_factory.mktemp(arch)]}


@pytest.fixture(scope="module")
def expected(checkpoints):
    """architecture -> (prompt ids, transformers' greedy continuations)."""
    tok = tiny.byte_tokenizer()
    out = {}
    for arch, (_, ref) in checkpoints.items():
        ids = [tok.encode(p) for p in PROMPTS]
        out[arch] = ids, tiny.greedy_batch(ref, ids, NEW_TOKENS)
    return out


def test_served_greedy_equals_transformers(checkpoints, expected):
    """A real `bullet launch` (prefill and decode workers sharing the weights) serving the Qwen2 model."""
    from tests.server_utils import ServerProcess

    path, _ = checkpoints[QWEN2]
    with ServerProcess("--model-path", str(path), "--dtype", "float32", "--max-total-tokens", "1024",
                       "--policy", "static") as server:
        status, body = server.post("/generate", {"text": PROMPTS, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert status == 200, body
    assert [b["output_ids"] for b in body] == expected[QWEN2][1]


def _logits(runner, ids: list[int]) -> list[torch.Tensor]:
    """The last logits of three steps over `ids`: a fresh prompt (its first half), a chunk after that
    cached prefix (all but the last token), a decode step (the last token)."""
    pages, half = list(range(-(-len(ids) // runner.page_size))), len(ids) // 2
    steps = [SeqChunk(ids[:half], 0, pages), SeqChunk(ids[half:-1], half, pages), SeqChunk(ids[-1:], len(ids) - 1, pages)]
    return [runner.forward([chunk]).last_logits[0] for chunk in steps]


# bf16 on Qwen3 only: its q/k norms are the stage bf16 changes; Qwen2's bias is the GEMM's, as in fp32
@pytest.mark.parametrize("arch, dtype", [(QWEN2, torch.float32), (QWEN3, torch.float32), (QWEN3, torch.bfloat16)],
                         ids=["qwen2-fp32", "qwen3-fp32", "qwen3-bf16"])
def test_fused_stages_and_paged_kernels_compute_the_reference(arch, dtype, checkpoints, expected, monkeypatch):
    """The GPU's path on CPU tensors: the fused RMSNorm/RoPE/SwiGLU Triton kernels (interpreted) and
    the Triton paged-attention kernels get q/k with Qwen2's bias added and Qwen3's norms applied,
    and give the torch lines' logits; and bf16 stays near fp32."""
    triton = pytest.importorskip("triton")
    from engines.model import fused
    from engines.model.triton_attention import TritonPagedKernels

    if not torch.cuda.is_available() and isinstance(fused._kernels().rope_kernel, triton.runtime.JITFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1: its kernels cannot run on CPU tensors")
    w = load_weights(str(checkpoints[arch][0]), dtype=dtype)
    model = build_model(w.config, w.state)
    ids = expected[arch][0][0] + expected[arch][1][0][:4]
    calls = []
    for name in ("rms_norm_triton", "rope_triton", "silu_mul_triton"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))

    def run(gpu_path: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(fused, "fused_on", lambda x: gpu_path)
        kernels = TritonPagedKernels() if gpu_path else None
        runner = ModelRunner(model, KVPool(w.config, 8, 16, dtype), paged=gpu_path, kernels=kernels)
        return [x.float() for x in _logits(runner, ids)]

    got = run(True)
    steps, layers = 3, w.config.num_hidden_layers
    norms_per_layer = 4 if w.config.qk_norm else 2  # Qwen3's q and k norms are fused kernels too
    assert calls.count("rms_norm_triton") == steps * (norms_per_layer * layers + 1)
    assert calls.count("rope_triton") == steps * layers * (2 if w.config.qk_norm else 1)
    want = run(False)
    if dtype == torch.float32:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        return
    # bf16: the fused kernels round once where the lines round after each op, and the paged kernels
    # sum in another order than SDPA: both differ from fp32 by bf16's noise, by no more than the lines
    fp32 = load_weights(str(checkpoints[arch][0]), dtype=torch.float32)
    exact = _logits(ModelRunner(build_model(fp32.config, fp32.state), KVPool(fp32.config, 8, 16, torch.float32)), ids)
    for fast, lines, ref in zip(got, want, exact):
        err_fast, err_lines = float((fast - ref).abs().max()), float((lines - ref).abs().max())
        print(f"bf16 vs fp32 logits (max |logit| {float(ref.abs().max()):.3g}): fused+paged {err_fast:.3g}, lines {err_lines:.3g}")
        assert err_fast <= 2 * err_lines + 0.05 and err_lines <= 0.1 * float(ref.abs().max())


@pytest.mark.parametrize("arch", [QWEN2, QWEN3])
def test_int8_model_keeps_bias_and_qk_norms(arch, checkpoints, expected):
    """The rotation behind int8 is exact in real arithmetic with Qwen2's v bias (rotated with its head)
    and Qwen3's q/k norms (passed through); the int8 model then stays near fp32 (on its serving path:
    attention over the pages in place, the C kernel)."""
    from engines.quant import quantize_state
    from engines.quant.int8 import fbgemm_available
    from engines.quant.rotation import rotate_state

    w = load_weights(str(checkpoints[arch][0]), dtype=torch.float32)
    ids = expected[arch][0][2] + expected[arch][1][2]

    def logits(state):  # each model on its CPU serving path (float: gather; int8: paged)
        return _logits(ModelRunner(build_model(w.config, state), KVPool(w.config, 8, 16, torch.float32)), ids)

    reference = logits(w.state)
    rotated, block = rotate_state(w.config, w.state)
    for name in [n for n in rotated if n.endswith("input_rotation")]:  # the float model has no online rotation
        rot = rotated.pop(name)
        weight = rotated[name.replace("input_rotation", "weight")]
        rotated[name.replace("input_rotation", "weight")] = (weight.view(weight.shape[0], -1, block) @ rot.T).reshape(weight.shape)
    for a, b in zip(logits(rotated), reference):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if not fbgemm_available():
        pytest.skip("torch without the fbgemm quantized engine")
    for a, b in zip(logits(quantize_state(w.config, w.state)), reference):
        similarity = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        print(f"{arch} int8 vs fp32 logits: cosine {similarity:.5f}, top-1 {int(a.argmax())} vs {int(b.argmax())}")
        assert similarity > 0.98  # measured 0.994-0.999; without the q/k/v bias 0.82


# -- what a checkpoint may not do -----------------------------------------------------------------------

def _copy(src, dst, config_update: dict | None = None):
    import shutil

    shutil.copytree(src, dst)
    if config_update is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_update}))
    return dst


def test_a_tensor_the_model_does_not_use_is_an_error_naming_it(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file


    # a Qwen2 checkpoint that says it is Llama: its q/k/v biases have no place (they used to be dropped)
    as_llama = _copy(checkpoints[QWEN2][0], tmp_path / "as-llama", {"architectures": ["LlamaForCausalLM"],
                                                                      "model_type": "llama"})
    with pytest.raises(ModelLoadError, match=r"LlamaForCausalLM model does not use: \['model.layers.0.self_attn.k_proj.bias'"):
        load_weights(str(as_llama))
    # a stray tensor in a Qwen3 checkpoint
    extra = _copy(checkpoints[QWEN3][0], tmp_path / "extra")
    tensors = load_file(str(extra / "model.safetensors"))
    save_file({**tensors, "model.layers.1.mlp.extra_proj.weight": torch.zeros(2, 2)}, str(extra / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"does not use: \['model.layers.1.mlp.extra_proj.weight'\]"):
        load_weights(str(extra))
    # a tensor the model needs but the checkpoint lacks
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'layers.1.self_attn.q_norm.weight' missing"):
        load_weights(str(extra))
    # what the model computes itself is accepted where it agrees (old transformers' RoPE frequencies, a
    # tied head stored anyway), an error where not
    tied = _copy(checkpoints[QWEN2][0], tmp_path / "tied")
    tensors = load_file(str(tied / "model.safetensors"))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16)
    derived = {"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}
    save_file({**tensors, **derived}, str(tied / "model.safetensors"), metadata={"format": "pt"})
    assert "lm_head.weight" not in load_weights(str(tied)).state
    for name, wrong in (("lm_head.weight", derived["lm_head.weight"] + 1), ("model.layers.0.self_attn.rotary_emb.inv_freq", inv_freq / 8)):
        save_file({**tensors, **derived, name: wrong}, str(tied / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match="differ"):
            load_weights(str(tied))


def test_sharded_checkpoint_reads_exactly_its_index(checkpoints, tmp_path):
    """Shards listed by model.safetensors.index.json: the same state as one file; a weight file the
    index does not list (another format's copy) is not read; a shard that disagrees with the index is
    an error."""
    from safetensors.torch import save_file


    path, ref = checkpoints[QWEN3]
    sharded = tmp_path / "sharded"
    ref.save_pretrained(str(sharded), max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / f).write_bytes((path / f).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(sharded / "consolidated.safetensors"))
    one, many = load_weights(str(path)), load_weights(str(sharded))
    assert one.state.keys() == many.state.keys()
    assert all(torch.equal(one.state[k], many.state[k]) for k in one.state)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.norm.weight")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="does not hold the tensors .* lists for it: \\['model.norm.weight'\\]"):
        load_weights(str(sharded))


def test_architecture_comes_from_the_config_and_unknown_ones_are_refused():
    from engines.architectures import UnsupportedModel

    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096}
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, "
                                               "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict({**base, "architectures": ["GPT2LMHeadModel"], "model_type": "llama"})
    with pytest.raises(UnsupportedModel, match="names no architecture"):
        ModelConfig.from_hf_dict(base)
    # Mistral is Llama's computation where no sliding window cuts the context
    for window in (None, 4096, 8192):
        cfg = ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": window})
        assert cfg.architecture == "MistralForCausalLM" and not (cfg.qkv_bias or cfg.qk_norm)
    with pytest.raises(UnsupportedModel, match="sliding window of 1024 tokens"):
        ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 1024})
    # Qwen's window only where switched on
    qwen = {**base, "architectures": [QWEN2], "sliding_window": 1024, "max_window_layers": 0}
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": False}).qkv_bias
    with pytest.raises(UnsupportedModel, match="sliding window"):
        ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True})
    for refused, match in (({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "gelu"),
                           ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**base, "architectures": [QWEN3], **refused})


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", QWEN2, QWEN3])
def test_config_counts_what_the_model_holds(arch):
    """num_parameters (the simulator's weight bytes) and dummy weights follow each family's tensors."""
    from engines.model.build import float_shapes
    from engines.weights.dummy import dummy_weights
    from engines.weights.layout import check_shapes

    cfg = ModelConfig.from_hf_dict(tiny.config(arch).to_dict() | {"architectures": [arch]})
    shapes = float_shapes(cfg)
    assert cfg.num_parameters() == sum(torch.Size(s).numel() for s in shapes.values())
    check_shapes(cfg, dummy_weights(cfg, torch.float32))


def test_the_estimators_kernel_sweeps_follow_the_qwen3_layer():
    """The profiler times a layer stage by stage (CPU: kernel_timing, GPU: cuda_ops); chained, the
    stages must be Qwen3's layer, q/k norms included (they are in its `rope` class)."""
    from engines.weights.dummy import dummy_weights
    from estimator.ops import layer_token_ops
    from estimator.profiler.cuda_ops import check_steps_compose_layer
    from estimator.profiler.kernel_timing import check_matches_model
    from estimator.profiler.workload import ModelBench, PrefillCase, uniform_decode

    cfg = ModelConfig.from_hf_dict(tiny.config(QWEN3).to_dict() | {"architectures": [QWEN3]})
    bench = ModelBench(cfg, dummy_weights(cfg, torch.float32), 256, torch.float32)
    for case in (PrefillCase((9, 4)), uniform_decode(2, 20)):
        check_steps_compose_layer(bench, case)
        check_matches_model(bench, case)
    rope = {op.name: op for op in layer_token_ops(cfg)}["rope"]
    plain = {op.name: op for op in layer_token_ops(cfg.model_copy(update={"qk_norm": False}))}["rope"]
    assert rope.bytes_per_row == 2 * plain.bytes_per_row
