"""Tensor parallelism of the engine (engines.tensor_parallel) against the unsplit model: real
processes, one rank each, summing through torch.distributed's gloo backend. A batched prefill of
three prompts, then greedy decode steps of all three, must give the unsplit model's logits (fp32,
up to summation order) and tokens — on the embedded SmolLM2 (3 KV heads: the 2 ranks hold 2 and 1),
a Qwen2 (QKV bias) and a Qwen3 (q/k norms, head_dim wider than hidden / heads) whose one KV head both
ranks hold."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.model_config import ModelConfig
from engines.runner import ModelRunner, SeqChunk
from engines.tensor_parallel import LeadingRunner, build_rank_model, follow, plan_shard, shard_config, shard_state
from engines.weights import load_weights

SPAWN = mp.get_context("spawn")
PAGE = 16
PAGES_PER_SEQ = 8  # 128 tokens a sequence
NEW_TOKENS = 8
ATOL = 1e-4  # fp32 logits: the all-reduce adds the ranks' partial sums in another order than one GEMM


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 23, 41)]


def run_steps(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits [1 + new_tokens, len(prompts), vocab] of a batched prefill then greedy batched decode
    steps, and the tokens chosen."""
    tables = [list(range(k * PAGES_PER_SEQ, (k + 1) * PAGES_PER_SEQ)) for k in range(len(prompts))]
    out = runner.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]).last_logits
    steps, tokens = [out], [[t] for t in out.argmax(-1).tolist()]
    for _ in range(new_tokens):
        chunks = [SeqChunk([toks[-1]], len(p) + len(toks) - 1, t) for p, toks, t in zip(prompts, tokens, tables)]
        out = runner.forward(chunks).last_logits
        steps.append(out)
        for toks, t in zip(tokens, out.argmax(-1).tolist()):
            toks.append(t)
    return torch.stack(steps), tokens


def _runner(config: ModelConfig, model) -> ModelRunner:
    return ModelRunner(model, KVPool(config, 3 * PAGES_PER_SEQ, PAGE, torch.float32))


def _rank(rank: int, group, model_path: str | None):
    weights = load_weights(model_path, "auto", torch.float32)
    config, model = build_rank_model(weights.config, weights.state, group.size(), rank, group)
    logits, tokens = run_steps(_runner(config, model), _prompts(weights.config.vocab_size), NEW_TOKENS)
    # as numpy (pickled by value: a torch tensor would be passed as a file descriptor of a process that exits)
    return logits.numpy(), tokens, config.num_attention_heads, config.num_key_value_heads


def _as_rank(work, rank: int, world: int, rendezvous: str, *args) -> None:
    """A rank's process: join the gloo group, send the parent what work(rank, group, *args) returns (or
    the exception it raised, as a string), leave the group together with the peers, and exit.

    The exit skips the interpreter's finalization (os._exit): torch can abort there (SIGABRT,
    "terminate called without an active exception", seen in shuffled CI runs after the results were
    sent) when a gloo worker thread is torn down with the interpreter, even after
    destroy_process_group. The exit code still says whether the group was left cleanly."""
    import gc
    import os

    import torch.distributed as dist

    *args, conn = args
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        conn.send(work(rank, dist.group.WORLD, *args))
    except Exception as exc:  # the parent reports it
        conn.send(repr(exc))
    code = 1
    try:
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
        code = 0
    finally:
        conn.close()
        os._exit(code)


def spawn_ranks(work, world: int, rendezvous: str, *args) -> list:
    """Run work(rank, group, *args) in `world` spawned processes, one rank each; each rank's answer
    (a string: the exception it raised, which fails the test)."""
    pipes = [SPAWN.Pipe(duplex=False) for _ in range(world)]
    procs = [SPAWN.Process(target=_as_rank, args=(work, r, world, rendezvous, *args, pipes[r][1])) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = []
        for reader, _ in pipes:
            assert reader.poll(300), "a rank did not answer within 5 minutes"
            results.append(reader.recv())
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
    failed = [r for r in results if isinstance(r, str)]
    assert not failed, failed
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def tp_run(model_path: str | None, world: int, tmp_path) -> list:
    """Each rank's (logits, tokens, its query heads, its KV heads)."""
    return spawn_ranks(_rank, world, str(tmp_path / f"rendezvous-{world}"), model_path)


def reference(model_path: str | None):
    weights = load_weights(model_path, "auto", torch.float32)
    runner = _runner(weights.config, build_model(weights.config, weights.state))
    return run_steps(runner, _prompts(weights.config.vocab_size), NEW_TOKENS)


def _assert_equal_to_reference(results, ref_logits, ref_tokens, heads):
    for rank, (logits, tokens, q, kv) in enumerate(results):
        assert (q, kv) == heads[rank], f"rank {rank} holds {q} query / {kv} KV heads"
        diff = (torch.from_numpy(logits) - ref_logits).abs().max().item()
        assert diff <= ATOL, f"rank {rank}: logits differ by {diff:.2e}"
        assert tokens == ref_tokens, f"rank {rank}: greedy tokens differ"


@pytest.fixture(scope="module")
def embedded_reference():
    return reference(None)


def test_the_embedded_model_split_over_two_ranks_computes_the_unsplit_logits(embedded_reference, tmp_path):
    """SmolLM2's 3 KV heads: rank 0 holds 2 (6 query heads), rank 1 holds 1 (3)."""
    _assert_equal_to_reference(tp_run(None, 2, tmp_path), *embedded_reference, [(6, 2), (3, 1)])


@pytest.mark.parametrize("arch,kv_heads,heads", [("Qwen2ForCausalLM", 2, [(2, 1), (2, 1)]),
                                                 ("Qwen3ForCausalLM", 1, [(2, 1), (2, 1)])],
                         ids=["qwen2-split-kv", "qwen3-replicated-kv"])
def test_other_families_split_over_two_ranks_compute_the_unsplit_logits(arch, kv_heads, heads, tmp_path):
    """Qwen2's QKV bias sliced with its rows (2 KV heads, one a rank); Qwen3's q/k norms with one KV
    head held by both ranks, each with 2 of its 4 query heads."""
    pytest.importorskip("transformers")
    from tests.engines import tiny_checkpoints as tiny

    path = tmp_path / arch
    tiny.save(arch, path, num_key_value_heads=kv_heads)
    ref_logits, ref_tokens = reference(str(path))
    _assert_equal_to_reference(tp_run(str(path), 2, tmp_path), ref_logits, ref_tokens, heads)


# -- one scheduler, two ranks: rank 0 leads, rank 1 follows --------------------------------------

def interleaved(runner) -> tuple[list[torch.Tensor], int]:
    """What a prefill worker does with preemption, then a decode step with a between-layers hook: batch
    A runs 10 layers, batch B (a preemptor) starts, runs and finishes, A finishes, then all three
    sequences decode one token. Returns the logits of each finish/forward and the hook's calls."""
    prompts = _prompts(runner.model.config.vocab_size)
    tables = [list(range(k * PAGES_PER_SEQ, (k + 1) * PAGES_PER_SEQ)) for k in range(3)]
    a = runner.start([SeqChunk(prompts[0], 0, tables[0]), SeqChunk(prompts[1], 0, tables[1], "all")])
    runner.run_layers(a, 10)
    b = runner.start([SeqChunk(prompts[2], 0, tables[2])])
    runner.run_layers(b)
    out_b = runner.finish(b)
    runner.run_layers(a)
    out_a = runner.finish(a)
    firsts = out_a.last_logits.argmax(-1).tolist() + out_b.last_logits.argmax(-1).tolist()
    hooks = []
    step = runner.forward([SeqChunk([t], len(p), tab) for t, p, tab in zip(firsts, prompts, tables)], hooks.append)
    return [out_a.last_logits, out_a.all_logits[1], out_b.last_logits, step.last_logits], len(hooks)


def _lead_or_follow(rank: int, group):
    weights = load_weights(None, "auto", torch.float32)
    config, model = build_rank_model(weights.config, weights.state, group.size(), rank, group)
    runner = _runner(config, model)
    if rank != 0:
        return follow(runner, group)
    leader = LeadingRunner(runner, group)
    outs, hooks = interleaved(leader)
    leader.stop()
    return [o.numpy() for o in outs], hooks


def test_a_follower_mirrors_the_leaders_calls_and_the_leader_gets_the_unsplit_logits(tmp_path):
    weights = load_weights(None, "auto", torch.float32)
    expected, expected_hooks = interleaved(_runner(weights.config, build_model(weights.config, weights.state)))
    got = spawn_ranks(_lead_or_follow, 2, str(tmp_path / "rendezvous"))
    (outs, hooks), follower_calls = got
    assert follower_calls == 8  # start, run_layers x2, start, run_layers, finish x2, forward
    assert hooks == expected_hooks == weights.config.num_hidden_layers - 1  # the hook is the leader's alone
    for name, o, e in zip(["A last", "A all", "B last", "decode"], outs, expected):
        diff = (torch.from_numpy(o) - e).abs().max().item()
        assert diff <= ATOL, f"{name}: logits differ by {diff:.2e}"


# -- the plan, without processes -----------------------------------------------------------------

def _config(heads: int, kv_heads: int, width: int = 96, **kw) -> ModelConfig:
    return ModelConfig(hidden_size=64, intermediate_size=width, num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=16, vocab_size=32, **kw)


def test_shards_cover_every_head_and_column_once():
    for heads, kv, world in [(9, 3, 2), (9, 3, 3), (8, 8, 3), (32, 8, 8), (8, 2, 4), (16, 1, 4)]:
        config = _config(heads, kv)
        shards = [plan_shard(config, world, r) for r in range(world)]
        q = [h for s in shards for h in range(s.q_start, s.q_end)]
        assert sorted(q) == list(range(heads)), (heads, kv, world)
        mlp = [c for s in shards for c in range(s.mlp_start, s.mlp_end)]
        assert mlp == list(range(config.intermediate_size))
        group = heads // kv
        for s in shards:  # a rank's query heads read only its KV heads
            assert s.kv_start * group <= s.q_start and s.q_end <= s.kv_end * group


def test_a_split_that_cannot_work_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        plan_shard(_config(9, 3), 4, 0)  # 3 KV heads, 4 ranks
    with pytest.raises(ValueError, match="mixture-of-experts"):
        plan_shard(_config(4, 2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8), 2, 0)
    with pytest.raises(ValueError, match="rank 2 of tp_size 2"):
        plan_shard(_config(4, 2), 2, 2)


def test_the_shards_of_a_projection_put_back_together_are_the_projection():
    config = _config(8, 4)
    torch.manual_seed(0)
    state = {"layers.0.qkv_proj.weight": torch.randn(config.q_size + 2 * config.kv_size, 64),
             "layers.0.o_proj.weight": torch.randn(64, config.q_size),
             "layers.0.gate_up_proj.weight": torch.randn(2 * config.intermediate_size, 64),
             "layers.0.down_proj.weight": torch.randn(64, config.intermediate_size),
             "norm.weight": torch.randn(64)}
    shards = [shard_state(state, config, plan_shard(config, 2, r)) for r in range(2)]
    x = torch.randn(3, config.q_size)
    # row-parallel: the partial products of the shards sum to the whole product
    parts = [s["layers.0.o_proj.weight"] @ x[:, r * config.q_size // 2:(r + 1) * config.q_size // 2].T
             for r, s in enumerate(shards)]
    assert torch.allclose(parts[0] + parts[1], state["layers.0.o_proj.weight"] @ x.T, atol=1e-5)
    local = shard_config(config, plan_shard(config, 2, 0))
    assert shards[0]["layers.0.qkv_proj.weight"].shape == (local.q_size + 2 * local.kv_size, 64)
    assert shards[0]["norm.weight"] is state["norm.weight"] or torch.equal(shards[0]["norm.weight"], state["norm.weight"])


def test_a_quantized_state_is_refused_by_name():
    config = _config(4, 2)
    state = {"layers.0.qkv_proj.qweight": torch.zeros(1, dtype=torch.int8), "layers.0.qkv_proj.scale": torch.ones(1)}
    with pytest.raises(ValueError, match="float weights"):
        shard_state(state, config, plan_shard(config, 2, 0))


def test_one_rank_is_the_model_itself(embedded_reference):
    weights = load_weights(None, "auto", torch.float32)
    config, model = build_rank_model(weights.config, weights.state, 1, 0, None)
    assert config == weights.config
    logits, _ = run_steps(_runner(config, model), _prompts(config.vocab_size), NEW_TOKENS)
    assert torch.equal(logits, embedded_reference[0])

