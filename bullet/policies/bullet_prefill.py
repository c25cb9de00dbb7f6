"""Bullet's prefill scheduler (Algorithm 1), one decision per layer-group step:

1. predict the TTFT of every in-flight and queued request; publish the P90; TTFT is "satisfied"
   when the P90 of predicted TTFT / target over all of them is within 1;
2. read decode's state (batch, context, predicted TPOT P90, pause budget) from the state buffer;
3. order the queue by least predicted latency, except requests that the reordering would make
   miss their TTFT target (or that waited too long): those keep arrival order, ahead;
4. with nothing in flight, batch from the head of the queue until the batch's arithmetic intensity
   reaches the device's ridge point (more tokens only add latency);
5. split the units: both SLOs broken → balanced; TPOT holding → decode gets the fewest units that
   keep it (none, i.e. decode pauses, during a burst if its pause budget covers this step; when no
   share is predicted to keep it, the fewest within 10 % of decode's best step); TPOT
   broken → prefill yields units until it holds; on the last step of a batch with an empty queue,
   prefill hands units back to decode — as many as it can without stretching that step by more
   than one decode step (giving away all its TTFT slack instead idles the device: the next
   arrival would queue behind a slow tail, found in simulation); a share that reaches into units a
   running decode step holds runs beside them until that step ends, claiming the rest for after it
   (`beside_decode_step`: a decode step keeps its units to its end);
6. when TPOT is broken and no split that leaves prefill its smallest share lets decode catch up, prefill
   yields (if TTFT holds, or fewer requests would miss TTFT than are decoding — attainment counts
   requests): it runs nothing for one decode step on every unit, then takes its next layer group —
   the limit of "shrink prefill's share" where the smallest share is large (1 of 2 CPU cores: found
   serving ShareGPT on the CPU, where the decode batch then kept missing TPOT on its one core).
   Yields alternate with prefill steps, so prefill always progresses.

`split_rule="aggregate"` (DuetServe's rule, an option): while TPOT holds and decode's pause budget
covers the next layer group on every unit, prefill takes every unit and decode pauses — the device
is shared in time, as one engine would — and it splits only when TPOT would break."""

from __future__ import annotations

import bisect
from typing import Callable

from bullet.types.request import Request, priority_first
from bullet.types.slo import SLO
from bullet.types.worker_state import Predictions, WorkerFlags, WorkerState
from bullet.policies.predict import (
    TPOT_MARGIN,
    LearningPredictor,
    Predictor,
    decode_seconds_over,
    percentile,
    predict_ttfts,
    prefill_costs,
    prefill_seconds,
    prefill_seconds_over,
)
from bullet.policies.preemption import choose_preemptors
from bullet.policies.views import PrefillDecision, PrefillPolicy, PrefillView, beside_size, largest_at_most

HAND_BACK_RULES = ("off", "decode-step", "bounded")
SPLIT_RULES = ("spatial", "aggregate")
SPLIT_GOALS = ("prefill-first", "throughput")
PREFILL_GROWS = ("after-decode-step", "at-once")  # when prefill takes units a running decode step holds
TTFT_AIM = 0.9  # "throughput": prefill may slow until the P90 of TTFT / target would reach this
MAX_PREFILL_SLOWDOWN = 2.0  # ... and never by more than this factor (the TTFT slack is a prediction)
BOUNDED_STRETCH = 0.1  # "bounded": the last layer group may take at most 10 % longer on a smaller share
MEMO_LIMIT = 4096  # decode_units_for answers kept per estimator epoch
NEAR_BEST = 0.1  # no share keeps TPOT but it holds: decode takes the fewest units within 10 % of its best step


class BulletPrefillPolicy(PrefillPolicy):
    name = "bullet"

    def __init__(self, est: Predictor, slo: SLO, feasible_units: list[int], layers_per_step: int, num_layers: int,
                 max_prefill_tokens: int, batch_token_limit: Callable[[int], int], max_wait_s: float = 30.0,
                 preemption: bool = True, hand_back: str = "bounded", layer_group: str = "fixed",
                 min_group_s: float = 0.01, split_rule: str = "spatial", split_goal: str = "prefill-first",
                 decode_units: list[int] | None = None, percentile: float = 0.9,
                 prefill_grow: str = "after-decode-step"):
        """`feasible_units`: prefill's own shares; `decode_units`: decode's beside them (default the same:
        a pool whose remainder joins prefill's shares differs by role). `percentile`: of the waiting
        requests' predicted TTFT / target that must stay within 1 (the paper's P90 by default; the
        `last_ttft_p90*` names keep the published fields' names)."""
        if not 0.0 < percentile <= 1.0:
            raise ValueError(f"percentile must lie in (0, 1], not {percentile}")
        self.percentile = percentile
        if hand_back not in HAND_BACK_RULES:
            raise ValueError(f"hand_back must be one of {HAND_BACK_RULES}, not {hand_back!r}")
        if split_rule not in SPLIT_RULES:
            raise ValueError(f"split_rule must be one of {SPLIT_RULES}, not {split_rule!r}")
        if prefill_grow not in PREFILL_GROWS:
            raise ValueError(f"prefill_grow must be one of {PREFILL_GROWS}, not {prefill_grow!r}")
        self.prefill_grow = prefill_grow
        if split_goal not in SPLIT_GOALS:
            raise ValueError(f"split_goal must be one of {SPLIT_GOALS}, not {split_goal!r}")
        self.split_rule, self.split_goal = split_rule, split_goal
        if layer_group not in ("fixed", "adaptive"):
            raise ValueError(f"layer_group must be fixed or adaptive, not {layer_group!r}")
        self.preemption, self.hand_back_rule = preemption, hand_back
        self.layer_group_rule, self.min_group_s = layer_group, min_group_s
        self.est, self.slo, self.feasible = est, slo, sorted(feasible_units)
        self.learner: LearningPredictor | None = est if hasattr(est, "observe_prefill") else None
        self.total = self.feasible[-1]
        self.decode_feasible = sorted(decode_units) if decode_units else list(self.feasible)
        # decode's possible shares (prefill keeps at least its smallest), fewest first
        self._decode_candidates = sorted(self.total - f for f in self.feasible if self.total - f > 0)
        # the share decode takes for each of them (fixed with the pool sizes): asked on every decision
        self._candidate_gets = [self.decode_gets(d) for d in self._decode_candidates]
        # prefill's shares that leave decode some units, and decode's share beside each (`balanced`)
        self._split_shares = [p for p in self.feasible if self.total - p > 0]
        self._split_gets = [self.decode_gets(self.total - p) for p in self._split_shares]
        self.k, self.num_layers, self.max_tokens = layers_per_step, num_layers, max_prefill_tokens
        self.batch_token_limit, self.max_wait_s = batch_token_limit, max_wait_s
        # decode_units_for's answers while the estimator's decode predictions stay the same (its
        # `prediction_epoch`): decode's batch changes once per decode step, prefill decides several
        # times per decode step, and each answer scans up to every share
        self._epoch_of = getattr(est, "prediction_epoch", None)
        self._units_for: dict[tuple, int | None] = {}
        self._units_for_epoch: int | None = None
        self.last_reason = ""
        self.last_ttft_p90 = 0.0
        self.last_ttft_ratio_p90 = 0.0  # P90 of predicted TTFT / target over the waiting requests
        self.yielded_last = False  # the previous decision was a yield: the next one runs prefill

    # -- Algorithm 1 --------------------------------------------------------------------------
    def decide(self, view: PrefillView) -> PrefillDecision:
        peer = view.peer
        decode_batch = peer.batch_size
        units_now = view.current_units or self.total
        inflight, suspended = view.inflight, view.suspended
        remaining = behind = 0.0
        if inflight is not None:
            remaining = behind = prefill_seconds(self.est, inflight.lengths, units_now, inflight.starts,
                                                 num_layers=inflight.remaining_layers, co_decode_batch=decode_batch)
        if suspended is not None:  # the preempted batch resumes after the one in flight
            behind += prefill_seconds(self.est, suspended.lengths, units_now, suspended.starts,
                                      num_layers=suspended.remaining_layers, co_decode_batch=decode_batch)
        costs = prefill_costs(view.queue, self.est, units_now, decode_batch)
        order = self.order_queue(view, behind, costs)
        ttfts = predict_ttfts(view.now, inflight.requests if inflight else [], remaining, [], costs)
        ttfts.update(predict_ttfts(view.now, suspended.requests if suspended else [], behind, order, costs))
        self.last_ttft_p90 = percentile(list(ttfts.values()), self.percentile)
        # queued requests count while a batch is in flight too: a short prompt arriving behind a long
        # batch can only be helped by speeding that batch up (found serving ShareGPT on the CPU);
        # a request decode handed back for recomputation has had its first token: TTFT is not its target
        held = (inflight.requests if inflight else []) + (suspended.requests if suspended else [])
        waiting = [r for r in held + order if r.first_token_time is None]
        satisfy = self._p90_ok(waiting, ttfts)
        preempt = False
        if inflight is not None:
            admit = self.preemptors(view, inflight, remaining, order, ttfts, units_now)
            preempt = bool(admit)
        else:
            admit = self.batch(order, view)
            if not admit:
                return PrefillDecision(units=units_now, predictions=self._predictions(0.0))
        batch_lens = [r.num_uncomputed for r in admit] if admit else inflight.lengths
        cached = [r.num_cached for r in admit] if admit else inflight.starts  # prefixes the batch attends to
        misses = sum(1 for r in waiting if ttfts[r] > self.slo.ttft_target(len(r.prompt_ids)))
        running = None if preempt else inflight
        admitted = set(admit)
        units, reason = self.split(view, batch_lens, satisfy, running, [r for r in order if r not in admitted], misses,
                                   cached)
        if preempt:
            reason = f"preempt at a layer boundary for {len(admit)} prompt(s); {reason}"
        self.last_reason = reason
        self.yielded_last = units == 0
        if units == 0:
            step = self.est.decode_time(peer.batch_size, peer.tokens_in_flight, self.total)
            return PrefillDecision(units=units_now, reason=reason, yield_s=step, predictions=self._predictions(0.0))
        claimed = units
        units = self.beside_decode_step(peer, units)
        layers = self.layer_group(batch_lens, units, self._remaining(running), peer, cached)
        step = prefill_seconds(self.est, batch_lens, units, cached, num_layers=layers, include_head=False,
                               co_decode_batch=decode_batch)
        return PrefillDecision(admit=admit, num_layers=layers, units=units, predicted_s=step, reason=reason,
                               predictions=self._predictions(step), preempt=preempt, lengths=list(batch_lens),
                               claimed_units=claimed if claimed != units else 0)

    def beside_decode_step(self, peer, units: int) -> int:
        """The share prefill runs on now, having chosen `units`: those, unless they reach into the
        units a running decode step holds — a decode step keeps its units to its end (a CUDA-graph
        replay), and prefill's thread blocks launched onto them leave that step crawling (in the
        simulator on the measured H200 a burst that took every SM made one 30 ms step of 76 requests
        take 780 ms, 0.75 s of each one's TPOT slack; arXiv at 9.5 req/s). Then the largest share
        beside that step's units, until it ends: the chosen share is published (`claimed_units`),
        and decode's next step takes its complement (none in a burst: decode pauses).
        `prefill_grow="at-once"`: the chosen share at once (the rule before)."""
        if (self.prefill_grow == "at-once" or peer.flags & WorkerFlags.PAUSED or peer.compute_units <= 0
                or peer.batch_size <= 0 or units + peer.compute_units <= self.total):
            return units
        return largest_at_most(self.feasible, self.total - peer.compute_units) or units

    def layer_group(self, batch_lens: list[int], units: int, remaining: int, peer,
                    cached: list[int] | None = None) -> int:
        """Layers the next step runs: `layers_per_step` ("fixed"), or as many as fit in about one
        decode step ("adaptive", MuxWise's N_PL): a small batch runs in one or two steps instead of
        paying a step's overhead per few layers, a large one still returns to the scheduler about as
        often as decode does."""
        if self.layer_group_rule == "fixed":
            return min(self.k, remaining)
        target = max(peer.step_pred_ms / 1e3 if peer.batch_size else 0.0, self.min_group_s)
        per_layer = prefill_seconds(self.est, batch_lens, units, cached, num_layers=1, include_head=False,
                                    co_decode_batch=peer.batch_size)
        return max(1, min(remaining, int(target / per_layer) if per_layer > 0 else remaining))

    def preemptors(self, view: PrefillView, inflight, remaining: float, order: list[Request],
                   ttfts: dict[Request, float], units: int) -> list[Request]:
        if not self.preemption or view.suspended is not None or not order:
            return []
        reserve = view.peer.batch_size + view.peer.queued_requests  # as `batch`: decode's next pages
        # only the highest priority waiting may jump ahead: a lower one must not start before it
        top = order[0].priority
        order = [r for r in order if r.priority == top] if order[-1].priority != top else order
        chosen = choose_preemptors(view.now, inflight, remaining, order, ttfts, self.est, self.slo, units,
                                   view.peer.batch_size, self.max_tokens, view.free_pages - reserve, view.page_size)
        return chosen[:view.free_slots]  # fewer of them run sooner still: each still makes its target

    def _predictions(self, step_s: float) -> Predictions:
        return Predictions(ttft_pred_p90_ms=self.last_ttft_p90 * 1e3, step_pred_ms=step_s * 1e3)

    def _remaining(self, inflight) -> int:
        return inflight.remaining_layers if inflight is not None else self.num_layers

    def _p90_ok(self, reqs: list[Request], ttfts: dict[Request, float]) -> bool:
        # P90 of the TTFT-to-target ratio: targets differ per request when they scale with length
        ratios = [ttfts[r] / self.slo.ttft_target(len(r.prompt_ids)) for r in reqs]
        self.last_ttft_ratio_p90 = percentile(ratios, self.percentile)
        return self.last_ttft_ratio_p90 <= 1.0

    # -- line 5: least predicted latency first, without starvation ---------------------------------
    def order_queue(self, view: PrefillView, remaining: float, costs: dict[Request, float]) -> list[Request]:
        fcfs = list(view.queue)
        if len(fcfs) < 2:
            return fcfs
        sjf = sorted(fcfs, key=lambda r: costs[r])
        in_sjf = predict_ttfts(view.now, [], remaining, sjf, costs)
        in_fcfs = predict_ttfts(view.now, [], remaining, fcfs, costs)
        urgent = [r for r in fcfs
                  if r.first_token_time is not None  # handed back by decode: its output stalls until it reruns
                  or view.now - r.arrival > self.max_wait_s
                  or (in_sjf[r] > self.slo.ttft_target(len(r.prompt_ids))
                      and in_fcfs[r] <= self.slo.ttft_target(len(r.prompt_ids)))]
        taken = set(urgent)  # requests hash by identity; a set keeps a long queue linear
        return priority_first(urgent + [r for r in sjf if r not in taken])

    # -- lines 10-13: batch until the arithmetic-intensity limit ---------------------------------
    def batch(self, order: list[Request], view: PrefillView) -> list[Request]:
        limit = min(self.max_tokens, self.batch_token_limit(view.current_units or self.total))
        reserve = view.peer.batch_size + view.peer.queued_requests  # a page each for decode to grow into
        pages = view.free_pages - reserve
        batch, tokens = [], 0
        for r in order:
            n = r.num_uncomputed
            need = -(-n // view.page_size)
            if (len(batch) >= view.free_slots or need > pages or (batch and tokens >= limit)
                    or (batch and tokens + n > self.max_tokens)):
                break
            batch.append(r)
            tokens += n
            pages -= need
        return batch

    # -- lines 14-19: the compute split -----------------------------------------------------------
    def split(self, view: PrefillView, batch_lens: list[int], satisfy: bool, inflight, order,
              ttft_misses: int = 0, cached: list[int] | None = None) -> tuple[int, str]:
        peer = view.peer
        b, ctx = peer.batch_size, peer.tokens_in_flight
        if b == 0:
            return self.total, "decode idle: prefill takes every unit"
        tokens = sum(batch_lens)
        tpot_p90 = peer.tpot_pred_p90_ms / 1e3
        tpot_ok = tpot_p90 <= self.slo.tpot
        d_min = self.decode_units_for(b, ctx, tokens, self.slo.tpot * TPOT_MARGIN)
        if (self.hand_back_rule != "off" and inflight is not None and inflight.remaining_layers <= self.k
                and not order and view.suspended is None and d_min is not None):
            p = self.hand_back(view, inflight, b, ctx, self._prefill_share(self.total - d_min))
            return p, "last layers: hand units back to decode"
        # decode must catch up, not just hold: aim its steps below target by how far it is over
        catch_up = None if tpot_ok else self.decode_units_for(
            b, ctx, tokens, self.slo.tpot * TPOT_MARGIN * self.slo.tpot / tpot_p90)
        # a yield saves every running request's TPOT at the cost of the queued ones' TTFT: take it
        # when TTFT holds, or when fewer requests would miss TTFT than are decoding
        if (not tpot_ok and catch_up is None and not self.yielded_last
                and (satisfy or ttft_misses < b)):
            return 0, "TPOT broken beyond any split: prefill yields a decode step"
        if not satisfy and not tpot_ok:
            return self.balanced(view, batch_lens, b, ctx, cached), "both SLOs at risk: balanced split"
        if tpot_ok:
            full_step = prefill_seconds(self.est, batch_lens, self.total, cached, num_layers=self.k, include_head=False)
            if peer.pause_budget_ms / 1e3 >= full_step:
                if not satisfy:
                    return self.total, "burst: decode pauses, TPOT still holds"
                if self.split_rule == "aggregate":
                    return self.total, "aggregate: decode pauses while its pause budget lasts"
            if d_min is None:  # no share keeps the aim: more units than its near-best buy decode nothing
                d = self.decode_near_best(b, ctx, tokens)
                return self._prefill_share(self.total - d), "TPOT has slack, no share keeps it: decode near its best"
            first = self._prefill_share(self.total - d_min)
            if self.split_goal == "throughput" and satisfy:
                p = self.throughput_share(batch_lens, cached, b, ctx, first)
                if p != first:
                    return p, "both SLOs hold: the split that does the most work per second"
            return first, "TPOT has slack: decode gets the fewest units that keep it"
        d = catch_up if catch_up is not None else self.total - self.feasible[0]
        return self._prefill_share(self.total - d), "TPOT at risk: prefill yields units"

    def throughput_share(self, batch_lens: list[int], cached: list[int] | None, batch: int, context: int,
                         first: int) -> int:
        """Prefill's share, at most `first` (so decode keeps at least the units that hold its TPOT), that
        maximises the work both phases do per second — each phase's speed on its share against its speed
        on every unit, summed — while prefill slows (against `first`) by no more than its waiting requests'
        TTFT slack allows (TTFT_AIM / their P90 ratio, at most MAX_PREFILL_SLOWDOWN). A prefill batch too
        small to fill the device gains little from its last units, and decode, memory-bound, gains much
        from them: on the measured H200 the split that serves most is rarely prefill-first (found by the
        simulator's ledger, bullet.sim.ledger)."""
        shares = [p for p in self._split_shares if p <= first]
        if len(shares) < 2 or first not in shares:
            return first
        gets = [g for p, g in zip(self._split_shares, self._split_gets) if p <= first]
        tokens = sum(batch_lens)
        *prefill, prefill_all = prefill_seconds_over(self.est, batch_lens, [*shares, self.total], cached,
                                                     num_layers=self.k, include_head=False, co_decode_batch=batch)
        *decode, decode_all = decode_seconds_over(self.est, batch, context, [*gets, self.total], tokens)
        ratio = self.last_ttft_ratio_p90
        bound = prefill[shares.index(first)] * (MAX_PREFILL_SLOWDOWN if ratio <= 0 else
                                                min(MAX_PREFILL_SLOWDOWN, max(1.0, TTFT_AIM / ratio)))
        best, best_rate = first, -1.0
        for p, t_p, t_d in zip(shares, prefill, decode):
            if t_p > bound or t_p <= 0 or t_d <= 0:
                continue
            rate = prefill_all / t_p + decode_all / t_d
            if rate > best_rate + 1e-9 or (abs(rate - best_rate) <= 1e-9 and p > best):
                best, best_rate = p, rate
        return best

    def _prefill_share(self, units: int) -> int:
        at = bisect.bisect_left(self.feasible, units)  # the fewest feasible units >= units (else all)
        return self.feasible[at] if at < len(self.feasible) else self.total

    def decode_units_for(self, batch: int, context: int, co_tokens: int, target: float) -> int | None:
        """Fewest units (leaving prefill at least its minimum) with a decode step within target."""
        epoch = self._epoch_of("decode") if self._epoch_of is not None else None
        if epoch is None:
            return self._decode_units_for(batch, context, co_tokens, target)
        if epoch != self._units_for_epoch or len(self._units_for) >= MEMO_LIMIT:
            self._units_for.clear()
            self._units_for_epoch = epoch
        key = (batch, context, co_tokens, target)
        if key in self._units_for:
            return self._units_for[key]
        units = self._units_for[key] = self._decode_units_for(batch, context, co_tokens, target)
        return units

    def _decode_units_for(self, batch: int, context: int, co_tokens: int, target: float) -> int | None:
        candidates = self._decode_candidates
        for d, step in zip(candidates, decode_seconds_over(self.est, batch, context, self._candidate_gets, co_tokens)):
            if step <= target:
                return d
        return None

    def decode_units_with_slack(self, batch: int, context: int, co_tokens: int) -> int:
        """Decode's share beside `co_tokens` of prefill while TPOT has slack (`split`): the fewest units
        that keep its aim, else near its best."""
        d = self.decode_units_for(batch, context, co_tokens, self.slo.tpot * TPOT_MARGIN)
        return d if d is not None else self.decode_near_best(batch, context, co_tokens)

    def decode_near_best(self, batch: int, context: int, co_tokens: int) -> int:
        """Fewest units (leaving prefill at least its minimum) whose decode step is predicted within
        NEAR_BEST of the fastest such share. Where decode's step barely depends on its units (an eager,
        launch-bound decode on a GPU: 71 ms on 24 SMs, 72 ms on 132 of an H200), that is a small share,
        and prefill, which scales, keeps the rest; before, decode took everything but prefill's minimum."""
        candidates = self._decode_candidates
        if not candidates:
            return self.total - self.feasible[0]
        times = dict(zip(candidates, decode_seconds_over(self.est, batch, context, self._candidate_gets, co_tokens)))
        bound = min(times.values()) * (1.0 + NEAR_BEST)
        return next(d for d in candidates if times[d] <= bound)

    def decode_gets(self, rest: int) -> int:
        """The share decode takes when `rest` units are left to it: the largest that fits
        (`BulletDecodePolicy.complement`; the same pool sizes serve both roles)."""
        return max((f for f in self.decode_feasible if f <= rest), default=rest)

    def hand_back(self, view: PrefillView, inflight, batch: int, context: int, usual: int) -> int:
        """Prefill's share for the last layer group: the fewest units that keep its requests' TTFT
        targets and stretch the group by at most BOUNDED_STRETCH ("bounded") — or by one decode
        step on the complement of its usual share ("decode-step", the rule before: that step is
        slow on a small complement, so the tail dropped to a few units and every arrival during it
        waited; found in simulation)."""
        lens, cached = inflight.lengths, inflight.starts
        layers = inflight.remaining_layers

        usual_s = prefill_seconds(self.est, lens, usual, cached, num_layers=layers, co_decode_batch=batch)
        if self.hand_back_rule == "bounded":
            allowed = usual_s * (1.0 + BOUNDED_STRETCH)
        else:
            allowed = usual_s + self.est.decode_time(batch, context, max(1, self.total - usual))
        fewer = self.feasible[:bisect.bisect_left(self.feasible, usual)]  # ascending: the fewest first
        groups = prefill_seconds_over(self.est, lens, fewer, cached, num_layers=layers, co_decode_batch=batch)
        for p, t in zip(fewer, groups):
            if t <= allowed and all(view.now + t - r.arrival <= self.slo.ttft_target(len(r.prompt_ids))
                                    for r in inflight.requests):
                return p
        return usual

    def balanced(self, view: PrefillView, batch_lens: list[int], batch: int, context: int,
                 cached: list[int] | None = None) -> int:
        """The split that equalizes how far each phase is over its target (minimizes the worse one)."""
        target_p = min(self.slo.ttft_target(n) for n in batch_lens)
        best, best_p = float("inf"), self.feasible[0]
        shares = self._split_shares
        prefill = prefill_seconds_over(self.est, batch_lens, shares, cached, co_decode_batch=batch)
        decode = decode_seconds_over(self.est, batch, context, self._split_gets, sum(batch_lens))
        for p, prefill_s, decode_s in zip(shares, prefill, decode):
            worst = max(prefill_s / target_p, decode_s / self.slo.tpot)
            if worst < best:
                best, best_p = worst, p
        return best_p

    def observe(self, decision: PrefillDecision, seconds: float, view: PrefillView,
                peer_after: WorkerState | None = None) -> None:
        lengths = decision.lengths
        if self.learner is None or not lengths or decision.num_layers <= 0:
            return
        # beside decode or alone: the online correction learns the two apart (estimator.calibration)
        batch = beside_size(view.peer, peer_after, "batch_size")
        # decision.num_layers is what ran (decided before the step: the in-flight batch object has
        # moved on by now, so its remaining layers no longer say)
        self.learner.observe_prefill(lengths, decision.units, seconds, num_layers=decision.num_layers,
                include_head=False, co_decode_batch=batch)
