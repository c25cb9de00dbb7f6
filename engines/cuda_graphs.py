"""Decode steps as CUDA graphs: one graph per batch bucket (per share, where the caller keys them),
captured on the stream the step runs on, replayed after the step's inputs are copied into the
buffer every graph reads.

On a GPU an eager decode step of a small batch costs more in Python and kernel launches than in
kernels; replaying a captured graph launches them all at once. What the graph computes is the eager
step's own code — the model's embedding, its `DecoderLayer`s, the paged KV write and attention, the
LM head — on the paged-attention tables (`PagedTables`): their page-table width is fixed (the most
pages a sequence can own), so one graph serves every context length; a step only rewrites the
inputs (`engines.decode_padding.DecodeInputs`). The body reads no device value on the host, which a
capture forbids: RoPE tables are grown once up front to every reachable position and looked up
without a bound check, the tables are converted on the device, the logits land in a buffer the
caller reads after the replay. The logits of every row of the bucket are computed (padding rows'
are dropped).

Graphs need paged attention whose kernels never read back device values (`graph_blocker`): on CUDA
the Triton kernels; the torch reference reads the context lengths with `.tolist()`. (A CPU never
runs graphs: the tests stand in a `GraphApi` that re-runs the body.)

Which graphs exist is the caller's decision: `capture(batches, key)` captures ahead of time (a
serving worker captures everything it may replay at start-up, `bullet.partition.decode_graphs`);
`forward(chunks, key)` captures a missing graph on first use unless told not to (benchmarks, the
doctor), releasing the least recently used past `max_graphs`. `key` names the share a graph is
captured for when replays keep their capture partition; None shares one graph per bucket.

`GraphApi` is the CUDA part: `TorchCudaGraphs` (torch.cuda.CUDAGraph, one memory pool shared by all
graphs — replays never overlap) on a GPU; the tests substitute one that re-runs the captured body."""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Protocol, Sequence

import torch

from engines.decode_padding import DecodeInputs, DecodeShape, batch_bucket, default_batch_buckets
from engines.forward_context import ForwardContext
from engines.model.paged_attention import PagedTables
from engines.runner import ModelRunner, SeqChunk, StepOutput

log = logging.getLogger("engines.cuda_graphs")
# Graphs share one memory pool and one input buffer, so a graph costs its driver-side kernel nodes
# (of the order of a MiB for a large model), not its activations: a green-context pool of ~16 shares
# times ~11 batch buckets fits.
DEFAULT_MAX_GRAPHS = 256


class CapturedGraph(Protocol):
    def replay(self) -> torch.Tensor:
        """Run the captured kernels again; returns the output tensor they wrote."""

    def release(self) -> None: ...


class GraphApi(Protocol):
    def capture(self, body: Callable[[], torch.Tensor]) -> CapturedGraph:
        """Capture `body` on the current stream (which the caller made the partitioned one)."""


class _TorchGraph:
    def __init__(self, graph, output: torch.Tensor):
        self.graph, self.output = graph, output

    def replay(self) -> torch.Tensor:
        self.graph.replay()  # launches on the current stream: the step's partitioned stream
        return self.output

    def release(self) -> None:
        self.graph.reset()


class TorchCudaGraphs:
    """`GraphApi` over torch.cuda.CUDAGraph. All graphs share one memory pool: a later capture reuses
    what earlier ones freed, which is safe because replays run one at a time (capture the largest
    batch first and the pool never grows past its working set)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[], torch.Tensor]) -> CapturedGraph:
        stream = torch.cuda.current_stream()
        body()  # warm-up on this stream: lazy initialisations (cuBLAS handles, Triton JIT) never in a capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            output = body()
        return _TorchGraph(graph, output)


def graph_blocker(runner: ModelRunner) -> str | None:
    """Why `runner`'s decode steps cannot be captured as CUDA graphs, or None when they can."""
    if not runner.paged:
        return "decode graphs read paged-attention tables and this runner gathers slot tables (not paged)"
    kernels = getattr(runner.kernels, "name", type(runner.kernels).__name__)
    if runner.device.type == "cuda" and kernels != "triton":
        return (f"the {kernels} paged-attention kernels read device values on the host, which a CUDA graph "
                "capture forbids: decode graphs need the triton kernels (is triton installed?)")
    model_blocker = getattr(getattr(runner, "model", None), "graph_blocker", None)
    if runner.device.type == "cuda" and model_blocker is not None:
        return model_blocker(runner.device)
    return None


def sequence_pages(runner: ModelRunner) -> int:
    """The most pages one sequence can own: the model's context or the whole KV pool, the smaller."""
    return -(-min(runner.max_context, runner.kv.num_slots) // runner.page_size)


class DecodeGraphs:
    """Runs decode steps of `runner` as CUDA graphs when their batch has a bucket."""

    def __init__(self, runner: ModelRunner, scratch_slot: int, graphs: GraphApi, max_batch: int,
                 batch_buckets: Sequence[int] | None = None, max_graphs: int = DEFAULT_MAX_GRAPHS):
        blocker = graph_blocker(runner)
        if blocker is not None:
            raise ValueError(blocker)
        ps = runner.page_size
        if not 0 <= scratch_slot < runner.kv.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} is outside the KV pool ({runner.kv.num_slots} slots)")
        if scratch_slot % ps:
            raise ValueError(f"scratch slot {scratch_slot} must be the first slot of a page (page size {ps}) "
                             "that no request owns")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.runner, self.scratch_slot, self.api, self.max_graphs = runner, scratch_slot, graphs, max_graphs
        self.all_buckets = tuple(sorted(set(batch_buckets or default_batch_buckets(max_batch))))
        self.batch_buckets = self.all_buckets  # those in use (`use_buckets`)
        self.width = sequence_pages(runner)
        self.inputs = DecodeInputs(self.all_buckets[-1], self.width, ps, scratch_slot, runner.kv.num_slots,
                                   runner.device)
        self._graphs: OrderedDict[tuple[int, Hashable], CapturedGraph] = OrderedDict()
        self._evicted: set[tuple[int, Hashable]] = set()
        self._logits: torch.Tensor | None = None  # [largest bucket, vocab]: every graph writes a prefix
        self.captures = self.replays = self.evictions = 0
        self.capture_seconds = 0.0
        # A graph reads the RoPE tables at the addresses they had when it was captured: growing them
        # later would leave it reading freed memory. So they are grown once, now, to every position
        # a request can reach (no sequence is longer than the KV pool).
        runner.model.rope.reserve(min(runner.max_context, runner.kv.num_slots))

    # -- which steps -----------------------------------------------------------------------------
    def shape_for(self, chunks: Sequence[SeqChunk]) -> DecodeShape | None:
        """The bucket a step runs in, or None when it must run eagerly: not a plain decode step
        (a prompt chunk, prompt logprobs), more rows than the largest bucket, or a context beyond
        the model's or the page tables'."""
        if not chunks or any(len(c.token_ids) != 1 or c.logits != "last" for c in chunks):
            return None
        batch = batch_bucket(len(chunks), self.batch_buckets)
        longest = max(c.start + 1 for c in chunks)
        if batch is None or longest > self.runner.max_context or -(-longest // self.runner.page_size) > self.width:
            return None
        return DecodeShape(batch, self.width * self.runner.page_size)

    def has(self, shape: DecodeShape | int, key: Hashable = None) -> bool:
        """Whether the graph of this bucket (a shape or a batch size) and key is captured."""
        return (getattr(shape, "batch", shape), key) in self._graphs

    # -- capturing ---------------------------------------------------------------------------------
    def use_buckets(self, buckets: Sequence[int]) -> None:
        """Run steps in these buckets only (a subset of `all_buckets` with the largest, so every
        batch still fits); graphs of the others are released."""
        buckets = tuple(sorted(set(buckets)))
        if not buckets or not set(buckets) <= set(self.all_buckets) or buckets[-1] != self.all_buckets[-1]:
            raise ValueError(f"buckets {buckets} must be a subset of {self.all_buckets} holding the largest")
        self.batch_buckets = buckets
        self.release(lambda batch, key: batch not in buckets)

    @torch.inference_mode()
    def capture(self, batches: Iterable[int], key: Hashable = None) -> int:
        """Capture the graphs of these buckets under `key` on the current stream, the largest first
        (smaller ones then fit in the pool memory it took); returns how many were new. Raises
        ValueError past `max_graphs`: a caller capturing ahead plans what fits."""
        batches = sorted(set(batches), reverse=True)
        unknown = [b for b in batches if b not in self.batch_buckets]
        if unknown:
            raise ValueError(f"batches {unknown} are not buckets in use {self.batch_buckets}")
        missing = [b for b in batches if (b, key) not in self._graphs]
        if len(self._graphs) + len(missing) > self.max_graphs:
            raise ValueError(f"{len(missing)} more graphs would exceed max_graphs ({len(self._graphs)} of "
                             f"{self.max_graphs} held)")
        gc.freeze()  # torch.cuda.graph collects garbage before each capture: over frozen objects that is cheap
        try:
            for batch in missing:
                self._capture(batch, key)
        finally:
            gc.unfreeze()
        return len(missing)

    def _capture(self, batch: int, key: Hashable) -> CapturedGraph:
        slot = (batch, key)
        if slot in self._evicted:
            log.warning("decode graph for batch %d, share %s captured again after its eviction: the steps in "
                        "use need more than max_graphs=%d graphs", batch, key, self.max_graphs)
        began = time.perf_counter()
        if self._logits is None:
            vocab = self.runner.model.config.vocab_size
            self._logits = torch.empty(self.all_buckets[-1], vocab, dtype=torch.float32, device=self.runner.device)
        # every row padding: the capture's warm-up really runs, and writes only the scratch slot
        self.inputs.upload(self.inputs.fill_padding(batch))
        graph = self.api.capture(lambda: self._body(batch))
        self._graphs[slot] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - began
        return graph

    def _body(self, batch: int) -> torch.Tensor:
        """The eager decode step's computation on the inputs of `batch` rows, all on the device."""
        model, ps, device = self.runner.model, self.runner.page_size, self.runner.device
        ids, positions, slots, lens, pages = self.inputs.views(batch)
        positions = positions.long()
        tables = PagedTables(pages.t().contiguous(), lens, torch.arange(batch + 1, dtype=torch.int32, device=device),
                             ps, max_q_len=1)
        ctx = ForwardContext(positions=positions, slot_mapping=slots.long(), q_lens=[1] * batch,
                             ctx_lens=[self.width * ps] * batch, all_decode=True, paged=tables,
                             kernels=self.runner.kernels)
        ctx.rope_cos, ctx.rope_sin = model.rope.lookup(positions)
        hidden = model.forward_layers(model.embed(ids.long()), 0, model.num_layers, ctx, self.runner.kv.tensor)
        out = self._logits[:batch]  # a contiguous prefix of the shared buffer
        out.copy_(model.compute_logits(hidden))
        return out

    # -- running -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], key: Hashable = None, capture: bool = True) -> StepOutput:
        """Run a decode step by graph replay; `key` names the share when graphs are per share. A
        missing graph is captured first (`capture`), else ValueError. The logits returned are valid
        until the next replay (the step samples from them first)."""
        shape = self.shape_for(chunks)
        if shape is None:
            raise ValueError("this step has no graph bucket: run it eagerly (check shape_for first)")
        slot = (shape.batch, key)
        graph = self._graphs.get(slot)
        if graph is not None:
            self._graphs.move_to_end(slot)
        elif not capture:
            raise ValueError(f"no graph captured for batch {shape.batch}, share {key}")
        else:
            while len(self._graphs) >= self.max_graphs:
                old, evicted = self._graphs.popitem(last=False)
                evicted.release()
                self._evicted.add(old)
                self.evictions += 1
            graph = self._capture(shape.batch, key)
        count = self.inputs.fill([c.token_ids[0] for c in chunks], [c.start for c in chunks],
                                 [c.page_table for c in chunks], shape.batch)
        self.inputs.upload(count)
        logits = graph.replay()
        self.replays += 1
        return StepOutput(logits[: len(chunks)])

    @property
    def captured(self) -> list[tuple[DecodeShape, Hashable]]:
        """(shape, key) of every graph held, least recently used first."""
        context = self.width * self.runner.page_size
        return [(DecodeShape(batch, context), key) for batch, key in self._graphs]

    def release(self, where: Callable[[int, Hashable], bool] | None = None) -> int:
        """Release every graph (or those whose (batch, key) `where` selects); returns how many."""
        gone = [slot for slot in self._graphs if where is None or where(*slot)]
        for slot in gone:
            self._graphs.pop(slot).release()
        return len(gone)
