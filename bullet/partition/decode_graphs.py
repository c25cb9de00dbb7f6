"""A worker's decode forward pass: CUDA-graph replays where the partition backend allows them
(`graph_policy`), the eager runner otherwise — chosen per step, on the worker's partitioned stream.
Every policy's decode-only steps go through it: the decode worker's steps, and the unified worker's
(`chunked`, `sglang`) hybrid steps that hold only decodes.

Graph mode `shared` replays one graph per batch bucket whatever the share; `per-share` keys graphs by
the share (`WorkerStream.share_key`: the green-context stream, or the libsmctrl mask's size), so a
graph only ever replays under the partition it was captured in.

Every graph a worker may replay is captured at start-up, before it reports ready (`capture_shares`):
none is ever captured while serving, so no request waits on a capture and no eviction can recapture
in a loop. A step whose bucket or share has no graph runs eagerly (counted in `missed`). When the
shares times the batch buckets exceed `max_graphs`, fewer buckets are kept (steps pad further).

Padding rows of a graph write their K/V into a scratch page the worker reserves in the shared
allocator under `SCRATCH_OWNER`, an id no request has; a restarted worker finds and reuses it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from bullet.partition.graph_policy import EAGER, PER_SHARE, GraphDecision
from bullet.partition.launch_stream import WorkerStream
from engines.cuda_graphs import DEFAULT_MAX_GRAPHS, DecodeGraphs, GraphApi, TorchCudaGraphs, graph_blocker
from engines.decode_padding import thin_buckets
from engines.runner import ModelRunner, SeqChunk, StepOutput

log = logging.getLogger("bullet.partition.graphs")
SCRATCH_OWNER = (1 << 62) + 0x5C  # page-owner id of the padding page; request ids are far smaller


def reserve_scratch_page(allocator) -> int:
    """The scratch page's id: the one this instance already reserved, else a new one."""
    held = allocator.pages_of(SCRATCH_OWNER) if hasattr(allocator, "pages_of") else []
    return held[0] if held else allocator.alloc(1, SCRATCH_OWNER)[0]


@dataclass(frozen=True)
class CapturePlan:
    """Which graphs to hold: `buckets` for each of `shares` (unit counts; empty in shared mode)."""

    shares: tuple[int, ...]
    buckets: tuple[int, ...]
    note: str = ""  # what did not fit, if anything

    @property
    def graphs(self) -> int:
        return max(1, len(self.shares)) * len(self.buckets)


def plan_capture(shares: Sequence[int], buckets: Sequence[int], max_graphs: int) -> CapturePlan:
    """Every bucket for every share when they fit in `max_graphs`; else fewer buckets per share
    (always the largest); else the largest bucket for the first `max_graphs` shares (`shares` in
    priority order). Empty `shares`: one set of graphs for all shares (shared mode)."""
    shares, buckets = tuple(dict.fromkeys(shares)), tuple(sorted(buckets))
    per_set = max_graphs // max(1, len(shares))
    if per_set >= len(buckets):
        return CapturePlan(shares, buckets)
    if per_set >= 1:
        kept = thin_buckets(buckets, per_set)
        return CapturePlan(shares, kept, f"{max(1, len(shares))} share(s) x {len(buckets)} batch buckets exceed "
                                         f"max_graphs={max_graphs}: buckets {list(kept)} only")
    return CapturePlan(shares[:max_graphs], buckets[-1:],
                       f"{len(shares)} shares exceed max_graphs={max_graphs}: batch {buckets[-1]} graphs for "
                       f"shares {list(shares[:max_graphs])} only; other shares decode eagerly")


class GraphedDecode:
    """`forward(chunks)` for decode steps. Call it inside `WorkerStream.step()`: graphs are
    replayed on the current stream."""

    def __init__(self, runner: ModelRunner, stream: WorkerStream, decision: GraphDecision,
                 graphs: DecodeGraphs | None = None):
        if decision.enabled and graphs is None:
            raise ValueError("graph mode needs a DecodeGraphs")
        self.runner, self.stream, self.decision = runner, stream, decision
        self.graphs = graphs if decision.enabled else None
        self.eager_steps = self.graph_steps = self.missed = 0
        self._warned: set[tuple[int, Hashable]] = set()

    def key(self):
        return self.stream.share_key() if self.decision.mode == PER_SHARE else None

    def __call__(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        graphs = self.graphs
        shape = graphs.shape_for(chunks) if graphs is not None else None
        if shape is not None:
            key = self.key()
            if graphs.has(shape, key):
                self.graph_steps += 1
                return graphs.forward(chunks, key, capture=False)
            self.missed += 1
            if (shape.batch, key) not in self._warned:  # once per graph: a serving loop must not log per step
                self._warned.add((shape.batch, key))
                log.warning("no decode graph captured for batch %d on share %s: such steps run eagerly",
                            shape.batch, key)
        self.eager_steps += 1
        return self.runner.forward(list(chunks))

    def capture_shares(self, shares: Sequence[int] | None = None) -> CapturePlan | None:
        """Hold exactly the graphs these shares (unit counts the partition backend can apply, in
        priority order; default: all of `feasible_units()`) may replay: graphs of other shares are
        released, the missing ones captured — each share applied in turn, its graphs captured on its
        stream, the share in force before restored. In shared mode one set serves every share and
        `shares` is ignored. Call it between steps (start-up, or a policy narrowing its shares)."""
        if self.graphs is None:
            return None
        graphs, partition = self.graphs, self.stream.partition
        if self.decision.mode == PER_SHARE:
            wanted = [partition.round_units(u) for u in (partition.feasible_units() if shares is None else shares)]
        else:
            wanted = []
        plan = plan_capture(wanted, graphs.all_buckets, graphs.max_graphs)
        if plan.note:
            log.warning("decode graphs: %s", plan.note)
        began, held = time.perf_counter(), graphs.captures
        graphs.use_buckets(plan.buckets)
        if not plan.shares:
            graphs.release(lambda batch, key: key is not None)
            with self.stream.step():  # captured on the stream they will replay on
                graphs.capture(plan.buckets, None)
        else:
            # the share keys first (applying a share is cheap), so graphs no longer wanted are released
            # before the new ones take memory; then each share's graphs on its own stream
            keys = set(self.stream.each_share(plan.shares))
            graphs.release(lambda batch, key: key not in keys)
            for key in self.stream.each_share(plan.shares):
                graphs.capture(plan.buckets, key)
        log.info("decode graphs (%s): %d captured in %.1f s, %d held: batch buckets %s%s", self.decision.mode,
                 graphs.captures - held, time.perf_counter() - began, len(graphs.captured), list(plan.buckets),
                 f" x shares {list(plan.shares)}" if plan.shares else "")
        return plan

    def release(self) -> None:
        if self.graphs is not None:
            self.graphs.release()


def build_graphed_decode(runner: ModelRunner, stream: WorkerStream, decision: GraphDecision, allocator,
                         max_batch: int, graph_api_factory: Callable[[], GraphApi] | None = None,
                         shares: Sequence[int] | None = None, max_graphs: int = DEFAULT_MAX_GRAPHS) -> GraphedDecode:
    """The decode forward for a worker, its graphs captured: graphs per `decision` (with a scratch
    page from `allocator`) for `shares` (see `GraphedDecode.capture_shares`), or the eager runner
    when the decision or the runner's attention kernels rule graphs out. `graph_api_factory`
    replaces torch.cuda graphs (tests)."""
    blocker = graph_blocker(runner) if decision.enabled else None
    if blocker is not None:
        log.warning("decode graphs: off, decode runs eagerly (%s)", blocker)
        return GraphedDecode(runner, stream, GraphDecision(EAGER, blocker))
    log.info("decode graphs: %s (%s)", decision.mode, decision.reason)
    if not decision.enabled:
        return GraphedDecode(runner, stream, decision)
    graph_api_factory = graph_api_factory or TorchCudaGraphs
    scratch = reserve_scratch_page(allocator) * runner.page_size
    with stream.step():  # its buffers are made on the stream that will use them (and ready when it ends)
        graphs = DecodeGraphs(runner, scratch, graph_api_factory(), max_batch=max_batch, max_graphs=max_graphs)
    decode = GraphedDecode(runner, stream, decision, graphs)
    decode.capture_shares(shares)
    return decode
