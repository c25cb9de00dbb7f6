"""A decode worker's forward pass: CUDA-graph replays where the partition backend allows them
(`graph_policy`), the eager runner otherwise — chosen per step, on the worker's partitioned stream.

Graph mode `shared` replays one graph per bucket whatever the share; `per-share` keys graphs by the
share (`WorkerStream.share_key`: the green-context stream, or the libsmctrl mask's size), so a graph
only ever replays under the partition it was captured in. Steps without a bucket run eagerly.

Padding rows of a graph write their K/V into a scratch page the worker reserves in the shared
allocator under `SCRATCH_OWNER`, an id no request has; a restarted worker finds and reuses it."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from bullet.partition.graph_policy import PER_SHARE, GraphDecision
from bullet.partition.launch_stream import WorkerStream
from engines.cuda_graphs import DecodeGraphs, GraphApi, TorchCudaGraphs
from engines.runner import ModelRunner, SeqChunk, StepOutput

log = logging.getLogger("bullet.partition.graphs")
SCRATCH_OWNER = (1 << 62) + 0x5C  # page-owner id of the padding page; request ids are far smaller


def reserve_scratch_page(allocator) -> int:
    """The scratch page's id: the one this instance already reserved, else a new one."""
    held = allocator.pages_of(SCRATCH_OWNER) if hasattr(allocator, "pages_of") else []
    return held[0] if held else allocator.alloc(1, SCRATCH_OWNER)[0]


class GraphedDecode:
    """`forward(chunks)` for decode steps. Call it inside `WorkerStream.step()`: graphs are
    captured on, and replayed on, the current stream."""

    def __init__(self, runner: ModelRunner, stream: WorkerStream, decision: GraphDecision,
                 graphs: DecodeGraphs | None = None):
        if decision.enabled and graphs is None:
            raise ValueError("graph mode needs a DecodeGraphs")
        self.runner, self.stream, self.decision = runner, stream, decision
        self.graphs = graphs if decision.enabled else None
        self.eager_steps = self.graph_steps = 0

    def key(self):
        return self.stream.share_key() if self.decision.mode == PER_SHARE else None

    def __call__(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        if self.graphs is not None and self.graphs.shape_for(chunks) is not None:
            self.graph_steps += 1
            return self.graphs.forward(chunks, self.key())
        self.eager_steps += 1
        return self.runner.forward(list(chunks))

    def release(self) -> None:
        if self.graphs is not None:
            self.graphs.release()


def build_graphed_decode(runner: ModelRunner, stream: WorkerStream, decision: GraphDecision, allocator,
                         max_batch: int, graph_api_factory: Callable[[], GraphApi] | None = None) -> GraphedDecode:
    """The decode forward for a worker: graphs per `decision` (with a scratch page from `allocator`),
    or the eager runner. `graph_api_factory` replaces torch.cuda graphs (tests)."""
    log.info("decode graphs: %s (%s)", decision.mode, decision.reason)
    if not decision.enabled:
        return GraphedDecode(runner, stream, decision)
    graph_api_factory = graph_api_factory or TorchCudaGraphs
    scratch = reserve_scratch_page(allocator) * runner.page_size
    graphs = DecodeGraphs(runner, scratch, graph_api_factory(), max_batch=max_batch)
    return GraphedDecode(runner, stream, decision, graphs)
