"""Runs a loop core's steps on the simulated device: the step's work is charged there (beside
whatever the other worker runs), and when it ends each request that the step samples gets a token —
a fixed id, with the same finish rules and virtual-time stamps a real token would get.

A worker may also pay a set-up the first time its prompt attention meets a fresh sequence of a new
length (`attention_setup_s` per such length) in a step of fresh sequences only (the engine's SDPA
path): a per-shape kernel plan that the worker builds on the host before that step's kernels run —
cuDNN's SDPA graph on Hopper, 50-70 ms per new length on an H200 in served step timelines. Its
device units idle meanwhile; the step's observed time includes it."""

from __future__ import annotations

from typing import Callable, Sequence

from bullet.loops.base import HybridItem, hybrid_shape
from bullet.loops.clock import Clock
from bullet.policies.views import InflightPrefill
from bullet.sim.device import DecodeWork, HybridWork, PrefillWork, SimulatedDevice
from bullet.sim.events import EventLoop
from bullet.sim.partition import SimulatedPartition
from bullet.types.finish import FinishChecker
from bullet.types.request import Request, total_seq_len
from bullet.types.roles import Role

SIM_TOKEN_ID = 0  # the token every simulated step "samples": not an EOS id of any shipped model


class SimExecutor:
    def __init__(self, role: Role, device: SimulatedDevice, partition: SimulatedPartition, clock: Clock,
                 finish: FinishChecker, on_step_end: Callable[[], None] = lambda: None,
                 token_times: dict[int, list[float]] | None = None, loop: EventLoop | None = None,
                 attention_setup_s: float = 0.0, layerwise_decode: bool = False, num_layers: int = 0):
        if not attention_setup_s >= 0:  # nan too
            raise ValueError(f"attention_setup_s must be >= 0, got {attention_setup_s}")
        if attention_setup_s and loop is None:
            raise ValueError("a set-up per new attention length needs the event loop to wait on")
        self.role, self.device, self.partition, self.clock, self.finish = role, device, partition, clock, finish
        self.loop, self.attention_setup_s = loop, attention_setup_s
        # decode steps run layer by layer, so a step can give units up between layers (the real worker's
        # executor on a CPU; a GPU's decode is one CUDA-graph replay with no boundary to yield at)
        self.layerwise_decode, self.num_layers = layerwise_decode and num_layers > 1, num_layers
        self._seen_lengths: set[int] = set()  # fresh sequence lengths whose attention plan this worker built
        self.setups = 0  # how many it built
        self.on_step_end = on_step_end  # the driver goes round again once the core has taken the step's end
        # where each token's time goes, by request uid (the request log's, for its TBT); None: nowhere
        self.token_times = token_times
        # `FinishChecker.quiet_until` of each request it emitted for (forgotten when it ends one)
        self._quiet: dict[int, int] = {}

    def _run(self, work, sampled: Sequence[Request], on_done: Callable[[float], None], layers: int = 0,
             at_layer: Callable[[int], None] | None = None) -> None:
        def ended(seconds: float) -> None:
            if sampled:
                self.emit_tokens(sampled)
            on_done(seconds)
            self.on_step_end()

        self.device.start(self.role.value, work, self.partition.current_units, ended, layers, at_layer)

    def _run_after(self, setup_s: float, work, sampled: Sequence[Request], on_done: Callable[[float], None]) -> None:
        """`_run`, after `setup_s` of set-up: the host builds the plans first, the kernels start after
        (on the units held then), and the step's observed time includes the set-up."""
        if not setup_s:
            self._run(work, sampled, on_done)
            return
        self.loop.at(self.clock.now() + setup_s, self._run, work, sampled, lambda seconds: on_done(seconds + setup_s))

    def setup_for(self, lengths: Sequence[int], starts: Sequence[int]) -> float:
        """Seconds of set-up a step of these sequences pays: where every one is fresh (nothing cached
        before it: the engine then runs SDPA per sequence, else its paged kernel, which needs no plan
        per shape), for each length this worker has not attended before; they are then seen."""
        if not self.attention_setup_s or any(starts):
            return 0.0
        new = {n for n in lengths if n not in self._seen_lengths}
        self._seen_lengths |= new
        self.setups += len(new)
        return self.attention_setup_s * len(new)

    def emit_token(self, req: Request) -> None:
        self.emit_tokens((req,))

    def emit_tokens(self, reqs: Sequence[Request]) -> None:
        """A token for each of `reqs`, all at this instant (a decode step samples every request). This
        runs for every token of a run: the finish rules are checked once a request holds as many
        tokens as `FinishChecker.quiet_until` says (before that they cannot end it — the same
        answers as checking every token, for a dictionary look-up per token instead of a call)."""
        now, stamps, quiet = self.clock.now(), self.token_times, self._quiet
        stamped, until_of, finish = stamps is not None, quiet.get, self.finish
        times_of = stamps.get if stamped else None
        for req in reqs:
            output, uid = req.output_ids, req.uid
            output.append(SIM_TOKEN_ID)
            if req.first_token_time is None:
                req.first_token_time = now
            if stamped:
                times = times_of(uid)
                if times is None:
                    stamps[uid] = [now]
                else:
                    times.append(now)
            until = until_of(uid)
            if until is None:
                until = quiet[uid] = finish.quiet_until(req, SIM_TOKEN_ID)
            if len(output) >= until:
                reason = finish.check(req)
                if reason is not None:
                    req.finish(reason, now)
                    del quiet[uid]

    def run_prefill(self, batch: InflightPrefill, layers: int, finishing: Sequence[Request] | None,
                    on_done: Callable[[float], None]) -> None:
        work = PrefillWork(tuple(batch.lengths), layers, include_head=finishing is not None, cached=tuple(batch.starts))
        # the plans are built in the first layer, then every layer of every later group reuses them
        setup = self.setup_for(batch.lengths, batch.starts) if batch.layers_done == 0 else 0.0
        self._run_after(setup, work, finishing or (), on_done)

    def run_decode(self, batch: Sequence[Request], on_done: Callable[[float], None],
                   between_layers: Callable[[int], None] | None = None) -> None:
        work = DecodeWork(len(batch), total_seq_len(batch))
        if between_layers is None or not self.layerwise_decode:  # one piece, as a CUDA-graph replay runs
            self._run(work, batch, on_done)
            return

        def at_layer(layers_done: int) -> None:  # the core may give units up; the step goes on with what it holds
            between_layers(layers_done)
            self.device.resize(self.role.value, self.partition.current_units)

        self._run(work, batch, on_done, layers=self.num_layers, at_layer=at_layer)

    def run_hybrid(self, items: Sequence[HybridItem], on_done: Callable[[float], None]) -> None:
        work = hybrid_work(items)
        # decode rows in the step: the paged kernel attends for every row, fresh chunks too
        setup = self.setup_for(*zip(*work.chunks)) if self.attention_setup_s and work.chunks and not work.batch else 0.0
        self._run_after(setup, work, [req for req, _, _, _, _, sample in items if sample], on_done)


def hybrid_work(items: Sequence[HybridItem]) -> HybridWork:
    """What the device computes for a hybrid batch (`hybrid_shape`)."""
    chunks, decodes, context = hybrid_shape(items)
    return HybridWork(tuple(chunks), decodes, context)
