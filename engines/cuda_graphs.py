"""Decode steps as CUDA graphs: captured per (batch bucket, context bucket[, share]) on the stream the
step runs on, replayed with the step's inputs copied into the graph's static tables.

On a GPU an eager decode step of a small batch costs more in Python and kernel launches than in
kernels; replaying a captured graph launches them all at once. What the graph computes is the eager
step's own code — the model's embedding, its `DecoderLayer`s, the paged KV write and attention, the
LM head — run on fixed-shape tables (`engines.decode_padding`). Two things differ from eager:
* RoPE: `RotaryEmbedding.forward` reads the largest position back to the host, which capture
  forbids, so the tables are grown once up front to every reachable position and `rotate` runs inside;
* the logits of every row of the bucket are computed (padding rows' are dropped).

Where a graph may run is the caller's decision (`bullet.partition.graph_policy`): `key` names the
share a graph is captured for when replays keep their capture partition; None shares one graph per
bucket across shares. Graphs are captured lazily, the first time a bucket is needed, and the least
recently used are released past `max_graphs`. The padded context tables of one graph hold
batch x context slots; beyond `max_graph_slots` a step runs eagerly instead.

`GraphApi` is the CUDA part: `TorchCudaGraphs` (torch.cuda.CUDAGraph, one memory pool shared by all
graphs — replays never overlap) on a GPU; the tests substitute one that re-runs the captured body,
which exercises the padding, static tables and layer loop on the CPU against the eager step."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Protocol, Sequence

import torch

from engines.decode_padding import (
    DEFAULT_CONTEXT_STEP,
    DecodeShape,
    batch_bucket,
    context_bucket,
    default_batch_buckets,
    pad_decode,
)
from engines.forward_context import ForwardContext
from engines.runner import ModelRunner, SeqChunk, StepOutput

DEFAULT_MAX_GRAPHS = 32
DEFAULT_MAX_GRAPH_SLOTS = 1 << 20  # 8 MiB of int64 slot table per graph


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
    what earlier ones freed, which is safe because replays run one at a time."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[], torch.Tensor]) -> CapturedGraph:
        stream = torch.cuda.current_stream()
        body()  # warm-up on this stream: lazy initialisations (cuBLAS handles, workspaces) never in a capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            output = body()
        return _TorchGraph(graph, output)


class _StaticDecode:
    """One captured graph and the device tables it reads."""

    def __init__(self, runner: ModelRunner, shape: DecodeShape, output: torch.Tensor, scratch_slot: int):
        dev, b, c = runner.device, shape.batch, shape.context
        self.shape = shape
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        # until loaded, every row is padding: whatever runs on these tables writes only the scratch slot
        self.slot_mapping = torch.full((b,), scratch_slot, dtype=torch.long, device=dev)
        self.kv_slots = torch.zeros(b, c, dtype=torch.long, device=dev)
        self.kv_slots[:, 0] = scratch_slot
        self.kv_valid = torch.zeros(b, 1, 1, c, dtype=torch.bool, device=dev)
        self.kv_valid[:, 0, 0, 0] = True
        self.ctx = ForwardContext(positions=self.positions, slot_mapping=self.slot_mapping, q_lens=[1] * b,
                                  ctx_lens=[c] * b, kv_slots=self.kv_slots, kv_valid=self.kv_valid, all_decode=True)
        self.output = output[:b]  # a contiguous prefix of the shared logits buffer
        self.graph: CapturedGraph | None = None

    def load(self, padded) -> None:
        for dst, src in ((self.ids, padded.token_ids), (self.positions, padded.positions),
                         (self.slot_mapping, padded.slot_mapping), (self.kv_slots, padded.kv_slots),
                         (self.kv_valid, padded.kv_valid.reshape(self.kv_valid.shape))):
            dst.copy_(torch.from_numpy(src))  # on the current stream, ordered before the replay


class DecodeGraphs:
    """Runs decode steps of `runner` as CUDA graphs when their shape has a bucket."""

    def __init__(self, runner: ModelRunner, scratch_slot: int, graphs: GraphApi, max_batch: int,
                 batch_buckets: Sequence[int] | None = None, context_step: int = DEFAULT_CONTEXT_STEP,
                 max_graphs: int = DEFAULT_MAX_GRAPHS, max_graph_slots: int = DEFAULT_MAX_GRAPH_SLOTS):
        if not 0 <= scratch_slot < runner.kv.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} is outside the KV pool ({runner.kv.num_slots} slots)")
        self.runner, self.scratch_slot, self.api = runner, scratch_slot, graphs
        self.batch_buckets = tuple(sorted(batch_buckets or default_batch_buckets(max_batch)))
        self.context_step, self.max_graphs, self.max_graph_slots = context_step, max_graphs, max_graph_slots
        self._graphs: OrderedDict[tuple, _StaticDecode] = OrderedDict()
        self._logits: torch.Tensor | None = None  # [largest bucket, vocab]: every graph writes a prefix
        self.captures = self.replays = 0
        # A graph reads the RoPE tables at the addresses they had when it was captured: growing them
        # later would leave it reading freed memory. So they are grown once, now, to every position
        # a request can reach (no sequence is longer than the KV pool).
        runner.model.rope.reserve(min(runner.max_context, runner.kv.num_slots))

    # -- which steps -----------------------------------------------------------------------------
    def shape_for(self, chunks: Sequence[SeqChunk]) -> DecodeShape | None:
        """The bucket a step runs in, or None when it must run eagerly: not a plain decode step
        (a prompt chunk, prompt logprobs), more rows than the largest bucket, a context beyond the
        model's, or a padded table larger than `max_graph_slots`."""
        if not chunks or any(len(c.token_ids) != 1 or c.logits != "last" for c in chunks):
            return None
        batch = batch_bucket(len(chunks), self.batch_buckets)
        longest = max(c.start + 1 for c in chunks)
        if batch is None or longest > self.runner.max_context:
            return None
        shape = DecodeShape(batch, min(context_bucket(longest, self.context_step), self.runner.max_context))
        return shape if shape.slots <= self.max_graph_slots else None

    # -- running -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], key: Hashable = None) -> StepOutput:
        """Run a decode step by graph replay; `key` names the share when graphs are per share.
        The logits returned are valid until the next replay (the step samples from them first)."""
        shape = self.shape_for(chunks)
        if shape is None:
            raise ValueError("this step has no graph bucket: run it eagerly (check shape_for first)")
        padded = pad_decode([c.token_ids[0] for c in chunks], [c.start for c in chunks],
                            [c.page_table for c in chunks], shape, self.runner.page_size, self.scratch_slot)
        entry = self._entry(shape, key, padded)
        entry.load(padded)
        logits = entry.graph.replay()
        self.replays += 1
        return StepOutput(logits[: padded.real])

    def _entry(self, shape: DecodeShape, key: Hashable, padded) -> _StaticDecode:
        slot = (shape, key)
        entry = self._graphs.get(slot)
        if entry is not None:
            self._graphs.move_to_end(slot)
            return entry
        while len(self._graphs) >= self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            old.graph.release()
        entry = _StaticDecode(self.runner, shape, self._logits_buffer(), self.scratch_slot)
        # the capture's warm-up really runs: on this step's tables it computes this step (the replay
        # then writes the same K/V again), never a stray write into a request's slots
        entry.load(padded)
        entry.graph = self.api.capture(lambda: self._body(entry))
        self.captures += 1
        self._graphs[slot] = entry
        return entry

    def _body(self, entry: _StaticDecode) -> torch.Tensor:
        """The eager decode step's computation on the entry's static tables."""
        model, kv = self.runner.model, self.runner.kv.tensor
        hidden = model.embed(entry.ids)
        for layer in model.layers:
            hidden = layer(hidden, entry.ctx, model.rope.rotate, kv[layer.layer_id, 0], kv[layer.layer_id, 1])
        entry.output.copy_(model.compute_logits(hidden))
        return entry.output

    def _logits_buffer(self) -> torch.Tensor:
        if self._logits is None:
            vocab = self.runner.model.config.vocab_size
            self._logits = torch.empty(self.batch_buckets[-1], vocab, dtype=torch.float32, device=self.runner.device)
        return self._logits

    @property
    def captured(self) -> list[tuple[DecodeShape, Hashable]]:
        return list(self._graphs)

    def release(self) -> None:
        for entry in self._graphs.values():
            entry.graph.release()
        self._graphs.clear()
