"""Qwen3-MoE against `transformers` on tiny random checkpoints it saved itself (2 layers, 8 experts of
width 32, 2 per token, fp32): greedy tokens equal through the offline API, with every layer sparse
and renormalised picks, and with a dense layer among sparse ones without renormalisation (logits,
routing and serving against transformers: `test_transformers_equivalence`). The grouped expert
path against a per-token loop; the Triton MoE kernels against the grouped path (interpreted without
a GPU); both checkpoint spellings of the experts; what a config or checkpoint may not do."""

from __future__ import annotations

import pytest
import torch

from engines.architectures import UnsupportedModel
from engines.kv_pool import KVPool
from engines.model import moe
from engines.model.build import build_model, float_shapes, model_class
from engines.model_config import ModelConfig
from engines.runner import ModelRunner, SeqChunk
from engines.weights import ModelLoadError, load_weights
from tests.engines import tiny_checkpoints as tiny

transformers = pytest.importorskip("transformers")

MOE = "Qwen3MoeForCausalLM"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village at the edge"]
NEW_TOKENS = 32
# sparse: every layer a mixture, picks renormalised (as the published Qwen3-MoE models);
# mixed: layer 0 dense (decoder_sparse_step 2), picks not renormalised (transformers' default)
VARIANTS = {"sparse": {}, "mixed": {"decoder_sparse_step": 2, "norm_topk_prob": False}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (directory, transformers' model)."""
    return {name: (path, tiny.save(MOE, path, **overrides))
            for name, overrides in VARIANTS.items() for path in [tmp_path_factory.mktemp(f"moe-{name}")]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_offline_greedy_equals_transformers(variant, checkpoints):
    import bullet

    path, ref = checkpoints[variant]
    llm = bullet.LLM(str(path), dtype="float32", max_total_tokens=1024)
    cfg = llm.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (MOE, 8, 2, 32)
    assert cfg.moe_layers == {"sparse": (0, 1), "mixed": (1,)}[variant]
    assert cfg.norm_topk_prob == (variant == "sparse") and cfg.qk_norm
    tok = tiny.byte_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    assert [o.prompt_ids for o in outs] == ids
    assert [o.output_ids for o in outs] == tiny.greedy_batch(ref, ids, NEW_TOKENS)


def _naive_moe(x, router, gate_up, down, top_k, renormalize):
    """Token by token, pick by pick: the definition."""
    out = torch.zeros_like(x)
    width = down.shape[2]
    for t in range(x.shape[0]):
        probs = torch.softmax((router @ x[t]).double(), dim=0)
        picked = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:top_k]
        total = sum(float(probs[e]) for e in picked)
        for e in picked:
            h = gate_up[e].double() @ x[t].double()
            a = torch.nn.functional.silu(h[:width]) * h[width:]
            w = float(probs[e]) / (total if renormalize else 1.0)
            out[t] += (w * (down[e].double() @ a)).to(x.dtype)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_per_token_loop(renormalize):
    """More experts than rows: most experts get no row, some several; a token's picks are distinct."""
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, experts, width, top_k = 5, 16, 12, 8, 3
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(experts, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * width, hidden, generator=gen) / 4
    down = torch.randn(experts, hidden, width, generator=gen) / 4
    weights, ids = moe.route(x @ router.T, top_k, renormalize)
    assert ids.shape == (tokens, top_k) and all(len(set(row)) == top_k for row in ids.tolist())
    assert len(set(ids.flatten().tolist())) < experts  # some experts idle
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    got = moe.grouped_experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, _naive_moe(x, router, gate_up, down, top_k, renormalize), atol=1e-5, rtol=1e-5)
    # a batch of one row, and rows that all pick the same experts
    same = x[:1].expand(4, -1).contiguous()
    w, i = moe.route(same @ router.T, top_k, renormalize)
    torch.testing.assert_close(moe.grouped_experts(same, w, i, gate_up, down),
                               _naive_moe(same, router, gate_up, down, top_k, renormalize), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_few_row_experts_take_their_faster_form_and_compute_the_same(dtype, monkeypatch):
    """Experts with 1 to 5 rows: on a CPU in float32 those with at most `moe.COLUMN_ROWS` rows run as
    weight @ columns (a single row padded to two), in bfloat16 those with at most
    `moe.NATIVE_BF16_ROWS` on torch's own GEMM (oneDNN off, and back on after), and on a CPU with AMX
    (said to be one here, whatever this one is) the others of at most `moe.WEIGHTS_FIRST_ROWS`
    weights-first, else in row form; every expert's output is the definition's (per row, per pick)
    whichever form ran, and the row form alone gives the same."""
    gen = torch.Generator().manual_seed(2)
    hidden, experts, width = 16, 7, 8
    # two distinct picks a row; rows per expert: 1, 2, 3, 4, 5, 1 and none
    ids = torch.tensor([[4, 3], [4, 3], [4, 3], [4, 3], [4, 2], [2, 1], [2, 1], [0, 5]])
    x = torch.randn(ids.shape[0], hidden, generator=gen).to(dtype)
    weights = torch.softmax(torch.randn(ids.shape, generator=gen), -1).to(dtype)
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=gen) / 4).to(dtype)
    down = (torch.randn(experts, hidden, width, generator=gen) / 4).to(dtype)
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = gate_up[e].double() @ x[t].double()
            want[t] += float(weights[t, j]) * (down[e].double() @ (torch.nn.functional.silu(h[:width]) * h[width:]))
    monkeypatch.setattr(moe, "KERNEL_EXPERT_ROWS", 0)  # where the C kernel is built it would take these (test_cpu_gemv)
    sizes, native, first = [], [], []
    real, real_native, real_first = moe._expert_columns, moe._without_onednn, moe._expert_weights_first
    monkeypatch.setattr(moe, "_expert_columns", lambda r, g, d: sizes.append(r.shape[0]) or real(r, g, d))
    monkeypatch.setattr(moe, "_expert_weights_first", lambda r, g, d: first.append(r.shape[0]) or real_first(r, g, d))
    monkeypatch.setattr(moe, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(moe, "_without_onednn", lambda: native.append(torch.backends.mkldnn.enabled) or real_native())
    mkldnn = torch.backends.mkldnn.enabled
    got = moe.grouped_experts(x, weights, ids, gate_up, down)
    assert torch.backends.mkldnn.enabled == mkldnn  # put back
    counts = [n for n in torch.bincount(ids.flatten(), minlength=experts).tolist() if n]
    fp32 = dtype == torch.float32
    assert sizes == ([n for n in counts if n <= moe.COLUMN_ROWS] if fp32 else []) and (not fp32 or 1 in sizes)
    assert len(native) == (0 if fp32 else len([n for n in counts if n <= moe.NATIVE_BF16_ROWS])) and (fp32 or native)
    assert first == ([] if fp32 else [n for n in counts if n > moe.NATIVE_BF16_ROWS]) and (fp32 or first)
    tol = {"atol": 1e-5, "rtol": 1e-5} if fp32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.double(), want, **tol)
    first.clear()
    monkeypatch.setattr(moe, "cpu_has_amx", lambda: False)  # measured faster with AMX only: the row form elsewhere
    torch.testing.assert_close(moe.grouped_experts(x, weights, ids, gate_up, down).double(), want, **tol)
    assert first == []
    monkeypatch.setattr(moe, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(moe, "COLUMN_ROWS", 0)
    monkeypatch.setattr(moe, "NATIVE_BF16_ROWS", 0)
    monkeypatch.setattr(moe, "WEIGHTS_FIRST_ROWS", 0)
    sizes.clear(), native.clear()
    torch.testing.assert_close(moe.grouped_experts(x, weights, ids, gate_up, down).double(), want, **tol)
    assert sizes == [] and native == [] and first == []
    with moe._without_onednn():
        assert not torch.backends.mkldnn.enabled
    assert torch.backends.mkldnn.enabled == mkldnn


def test_fused_stages_and_paged_kernels_compute_the_reference(checkpoints, monkeypatch):
    """The GPU's path on CPU tensors (the fused Triton RMSNorm/RoPE/SwiGLU stages, interpreted, and the
    Triton paged-attention kernels): the grouped experts' SwiGLU products go through the fused
    kernel, then the experts through the Triton MoE kernels, and the logits equal the torch lines'."""
    _interpreted_triton()
    from engines.model import fused
    from engines.model.triton_attention import TritonPagedKernels

    path, _ = checkpoints["mixed"]
    w = load_weights(str(path))
    model = build_model(w.config, w.state)
    ids = tiny.byte_tokenizer().encode(PROMPTS[2])
    calls = []
    real = fused.silu_mul_triton
    monkeypatch.setattr(fused, "silu_mul_triton", lambda g: calls.append(g.shape[0]) or real(g))

    def run(gpu_path: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(fused, "fused_on", lambda x: gpu_path)
        runner = ModelRunner(model, KVPool(w.config, 8, 16, torch.float32), paged=gpu_path,
                             kernels=TritonPagedKernels() if gpu_path else None)
        pages, half = [0, 1, 2, 3], len(ids) // 2
        steps = [SeqChunk(ids[:half], 0, pages), SeqChunk(ids[half:-1], half, pages), SeqChunk(ids[-1:], len(ids) - 1, pages)]
        return [runner.forward([chunk]).last_logits[0] for chunk in steps]

    got = run(True)
    # per step: the dense layer's one product over every row, then one per expert the rows picked
    assert sum(calls) == len(ids) * (1 + w.config.num_experts_per_tok) and len(calls) > 3
    want = run(False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # and the experts through the Triton MoE kernels, as on a GPU (no SwiGLU stage of their own then)
    launches = []
    real_fused = moe._triton_moe().fused_experts
    monkeypatch.setattr(moe, "triton_on", lambda x: True)
    monkeypatch.setattr(moe._triton_moe(), "fused_experts", lambda *a: launches.append(a[0].shape[0]) or real_fused(*a))
    calls.clear()
    for a, b in zip(run(True), want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert launches == [len(ids) // 2, len(ids) - 1 - len(ids) // 2, 1] and sum(calls) == len(ids)


def _interpreted_triton():
    triton = pytest.importorskip("triton")
    from engines.model import fused

    if not torch.cuda.is_available() and isinstance(fused._kernels().rope_kernel, triton.runtime.JITFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1: its kernels cannot run on CPU tensors")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_moe_kernels_compute_the_grouped_path(dtype):
    """Token-expert alignment and the two grouped GEMMs (interpreted without a GPU) against the grouped
    torch path: experts with several blocks of rows, experts with none, a width and a hidden size
    that the tiles do not divide, one row."""
    device = _interpreted_triton()
    from engines.model import triton_moe

    gen = torch.Generator().manual_seed(2)
    for tokens, hidden, width, experts, top_k in ((40, 40, 24, 4, 3), (6, 32, 16, 10, 2), (1, 32, 16, 128, 8)):
        x = torch.randn(tokens, hidden, generator=gen)
        router = torch.randn(experts, hidden, generator=gen)
        gate_up = torch.randn(experts, 2 * width, hidden, generator=gen) / 4
        down = torch.randn(experts, hidden, width, generator=gen) / 4
        x, router, gate_up, down = (t.to(device, dtype) for t in (x, router, gate_up, down))
        weights, ids = moe.route(x @ router.T, top_k, True)
        slots, block_expert = triton_moe.align(ids, experts, 16)
        rows = tokens * top_k
        assert sorted(s for s in slots.tolist() if s < rows) == list(range(rows))  # every row in one slot
        assert block_expert.tolist() == sorted(block_expert.tolist())
        flat = ids.reshape(-1).tolist()
        for b, e in enumerate(block_expert.tolist()):  # a block's rows are its expert's
            assert all(flat[s] == e for s in slots[b * 16:(b + 1) * 16].tolist() if s < rows)
        got = triton_moe.fused_experts(x, weights, ids, gate_up, down, block_m=16, block_n=16, block_k=16)
        want = moe.grouped_experts(x, weights, ids, gate_up, down)
        # bf16: one rounding per kernel against the grouped path's three: a few units in the last place
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_both_expert_spellings_load_the_same_and_nothing_else(checkpoints, tmp_path):
    """transformers' save_pretrained writes the hub's one matrix per expert; with
    save_original_format=False, its stacked [E, 2I, H] / [E, H, I] tensors. Both read alike; a
    checkpoint holding both, an expert too many or one missing is an error naming the tensor."""
    from safetensors.torch import load_file, save_file

    path, ref = checkpoints["sparse"]
    stacked = tmp_path / "stacked"
    ref.save_pretrained(str(stacked), save_original_format=False)
    keys = load_file(str(stacked / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    one, other = load_weights(str(path)).state, load_weights(str(stacked)).state
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)

    per_expert = load_file(str(path / "model.safetensors"))
    both = tmp_path / "both"
    both.mkdir()
    (both / "config.json").write_text((path / "config.json").read_text())
    save_file({**per_expert, "model.layers.1.mlp.experts.down_proj": torch.zeros(8, 64, 32)},
              str(both / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"does not use: \['model.layers.1.mlp.experts.0.down_proj.weight'"):
        load_weights(str(both))
    extra = {**per_expert, "model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}
    save_file(extra, str(both / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"does not use: \['model.layers.0.mlp.experts.8.up_proj.weight'\]"):
        load_weights(str(both))
    del per_expert["model.layers.1.mlp.experts.3.gate_proj.weight"]
    save_file(per_expert, str(both / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'layers.1.mlp.experts.3.gate_proj.weight' missing"):
        load_weights(str(both))
    no_experts = {k: v for k, v in per_expert.items() if ".layers.1.mlp.experts." not in k}
    save_file(no_experts, str(both / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'layers.1.mlp.experts.0.gate_proj.weight' missing.*or stacked"):
        load_weights(str(both))


def test_int8_is_refused_for_moe(checkpoints):
    with pytest.raises(ModelLoadError, match="w8a8_int8 has no form for Qwen3MoeForCausalLM's mixture-of-experts"):
        load_weights(str(checkpoints["sparse"][0]), quantization="w8a8_int8")


def _cfg(**overrides) -> dict:
    return tiny.config(MOE).to_dict() | {"architectures": [MOE]} | overrides


def test_config_fields_and_refusals():
    # transformers >= 5 writes num_local_experts; the hub's configs num_experts
    hub = {k: v for k, v in _cfg().items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ModelConfig.from_hf_dict(hub).num_experts == ModelConfig.from_hf_dict(_cfg()).num_experts == 8
    assert ModelConfig.from_hf_dict(_cfg(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])).moe_layers == (1, 5)
    dense = ModelConfig.from_hf_dict(_cfg(mlp_only_layers=[0, 1]))
    assert not dense.is_moe and dense.num_experts == 0  # no sparse layer: Qwen3's dense decoder
    for refused, match in (({"num_experts": 6, "num_local_experts": 8}, "disagree"),
                           ({"num_experts_per_tok": 9}, "num_experts_per_tok must lie in"),
                           ({"num_experts_per_tok": 0}, "num_experts_per_tok must lie in"),
                           ({"shared_expert_intermediate_size": 64}, "shared experts"),
                           ({"mlp_only_layers": [2]}, "mlp_only_layers"),
                           ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                           ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
                           ({"attention_bias": True}, "Qwen3MoeForCausalLM with attention_bias"),
                           ({"use_sliding_window": True, "sliding_window": 128}, "sliding window")):
        with pytest.raises(UnsupportedModel, match=match):
            ModelConfig.from_hf_dict(_cfg(**refused))


@pytest.mark.parametrize("overrides", [{}, {"decoder_sparse_step": 2}], ids=["sparse", "mixed"])
def test_config_counts_what_the_model_holds(overrides):
    """num_parameters (the simulator's weight bytes), its active count and dummy weights follow the
    experts; the kernel sweeps refuse the mixture layers rather than time something else."""
    from engines.weights.dummy import dummy_weights
    from engines.weights.layout import check_shapes
    from estimator.profiler.workload import ModelBench, PrefillCase

    cfg = ModelConfig.from_hf_dict(_cfg(**overrides))
    assert cfg.num_parameters() == sum(torch.Size(s).numel() for s in float_shapes(cfg).values())
    expert = 3 * 64 * 32
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == len(cfg.moe_layers) * (8 - 2) * expert
    state = dummy_weights(cfg, torch.float32)
    check_shapes(cfg, state)
    from estimator.profiler.kernel_timing import kernel_times

    with pytest.raises(ValueError, match="mixture-of-experts layers are not swept"):
        kernel_times(ModelBench(cfg, state, 64, torch.float32), PrefillCase((8,)))


def test_decode_graphs_need_the_experts_off_the_host(monkeypatch):
    """The grouped path reads its row counts on the host: no CUDA graph of it. The Triton path (where
    triton imports and the fused kernels are on) reads none."""
    from types import SimpleNamespace

    from engines.cuda_graphs import graph_blocker
    from engines.model import fused

    cfg = ModelConfig.from_hf_dict(_cfg())
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    runner = SimpleNamespace(paged=True, kernels=SimpleNamespace(name="triton"), device=torch.device("cuda"), model=model)
    monkeypatch.setattr(moe, "_triton_moe", lambda: object())
    assert graph_blocker(runner) is None
    monkeypatch.setattr(fused, "ENABLED", False)
    assert "group their rows by expert on the host" in graph_blocker(runner)
    monkeypatch.setattr(fused, "ENABLED", True)
    monkeypatch.setattr(moe, "_triton_moe", lambda: None)
    assert "group their rows by expert on the host" in graph_blocker(runner)
    runner.device = torch.device("cpu")  # a CPU never runs graphs
    assert graph_blocker(runner) is None
