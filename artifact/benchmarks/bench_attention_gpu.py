"""Decode attention on a GPU: the Triton paged kernels against the gather path, per layer.

  python artifact/benchmarks/bench_attention_gpu.py [--shapes 1x1024 32x1024 128x512] [--iters N]

Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head dim 128, bfloat16) over a pool of
16-token pages handed out in shuffled order, every sequence of a shape at the same context. For each
shape it times one layer's decode attention:

* `gather`: the path the GPU ran before the paged kernels (`engines.model.attention` with a
  decode plan): copy every context's K/V into padded tensors, then batched matmuls and a softmax;
* `triton`: `TritonPagedKernels.decode`, launched eagerly;
* `triton graph`: the same call captured in a CUDA graph and replayed (what a graph-captured decode
  step pays: no launch overhead);

and puts each against the memory floor of the layer: the K/V bytes it must read / the device's
copy bandwidth (measured here first, a 1 GiB device-to-device copy). The plan of the gather path
is built outside the timing (the runner builds it once per step, for all layers). Medians of 5
rounds of `--iters` calls, timed with CUDA events. Needs a CUDA GPU: without one it says so and
exits with status 0, measuring nothing. Writes artifact/results/attention_gpu.json and a table."""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import numpy as np
import torch

from artifact.benchmarks.common import print_table, write_results
from engines.decode_groups import plan_decode
from engines.forward_context import ForwardContext
from engines.model.attention import paged_attention
from engines.model.paged_attention import build_tables

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DEFAULT_SHAPES = ("1x1024", "32x1024", "128x512")


def _median_ms(fn, iters: int, rounds: int = 5) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write), 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters=10)
    del src, dst
    return 2 * (1 << 30) / (ms / 1e3)


def measure(batch: int, context: int, iters: int, bandwidth: float, device: torch.device) -> dict:
    from engines.model.triton_attention import TritonPagedKernels  # deferred: triton is checked in main()

    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq + 1
    pool = torch.randn(2, KV_HEADS, num_pages * PAGE_SIZE, HEAD_DIM, device=device).to(DTYPE)
    k_cache, v_cache = pool[0], pool[1]
    order = list(range(num_pages))
    random.Random(0).shuffle(order)
    tables_host = [order[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(batch)]
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device).to(DTYPE)
    scale = HEAD_DIM ** -0.5

    tables = build_tables(tables_host, [context] * batch, [1] * batch, PAGE_SIZE, device)
    kernels = TritonPagedKernels()
    out = torch.empty_like(q)
    triton_ms = _median_ms(lambda: kernels.decode(q, k_cache, v_cache, tables, scale, out=out), iters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.decode(q, k_cache, v_cache, tables, scale, out=out)
    graph_ms = _median_ms(graph.replay, iters)

    pos = np.arange(context)
    slots = np.asarray(tables_host, dtype=np.int64)[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    plan = plan_decode(np.arange(batch), np.full(batch, context), slots, KV_HEADS, k_cache.shape[1], DTYPE, device)
    ctx = ForwardContext(positions=torch.zeros(batch, dtype=torch.long, device=device),
                         slot_mapping=torch.zeros(batch, dtype=torch.long, device=device), q_lens=[1] * batch,
                         ctx_lens=[context] * batch, all_decode=True, decode_plan=plan)
    gather_ms = _median_ms(lambda: paged_attention(q, None, None, k_cache, v_cache, ctx, scale), iters)
    want = paged_attention(q, None, None, k_cache, v_cache, ctx, scale)
    graph.replay()
    torch.cuda.synchronize()

    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * pool.element_size()
    floor_ms = kv_bytes / bandwidth * 1e3
    return {"shape": f"{batch}x{context}", "kv_MB": kv_bytes / 1e6, "floor_us": floor_ms * 1e3,
            "gather_us": gather_ms * 1e3, "triton_us": triton_ms * 1e3, "triton_graph_us": graph_ms * 1e3,
            "graph_x_floor": graph_ms / floor_ms, "gather_x_triton": gather_ms / triton_ms,
            "max_abs_diff": float((out.float() - want.float()).abs().max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BATCHxCONTEXT, e.g. 32x1024")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    shapes = []
    for text in args.shapes:
        try:
            batch, context = (int(x) for x in text.lower().split("x"))
        except ValueError:
            parser.error(f"shape {text!r} is not BATCHxCONTEXT")
        if batch < 1 or context < 1:
            parser.error(f"shape {text!r} needs a batch and a context of at least 1")
        shapes.append((batch, context))
    if not torch.cuda.is_available():
        print("bench_attention_gpu: no CUDA GPU here (torch.cuda.is_available() is False): nothing measured")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError as e:
        print(f"bench_attention_gpu: triton does not import ({e}): install it next to the CUDA torch", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows = [measure(b, c, args.iters, bandwidth, device) for b, c in shapes]
    name = torch.cuda.get_device_name(device)
    path = write_results("attention_gpu", {"device": name, "copy_bandwidth_GBps": bandwidth / 1e9,
                                           "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                           "page_size": PAGE_SIZE, "dtype": str(DTYPE), "rows": rows})
    print_table(rows, ["shape", "kv_MB", "floor_us", "gather_us", "triton_us", "triton_graph_us", "graph_x_floor",
                       "gather_x_triton", "max_abs_diff"],
                title=f"decode attention per layer, {name}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
