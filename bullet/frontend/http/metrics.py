"""Prometheus metrics, under SGLang's names for what both servers have (so SGLang dashboards work
unchanged) and under `bullet:` for what only Bullet has.

* `sglang:*` — request and token counters, the TTFT / inter-token / end-to-end histograms (recorded
  as requests finish; label `model_name`), and, read from the state buffer and the page allocator at
  scrape time, running and queued requests per worker (`engine_type`: prefill, decode, or unified for
  the chunked baseline's single worker) and the KV pool's usage; `sglang:cache_hit_rate` is the share
  of finished requests' prompt tokens that the prefix cache served (`sglang:cached_tokens` over
  `sglang:prompt_tokens`).
* `bullet:*` — each worker's compute share, its scheduling decisions and repartitions (changes of
  its share), steps, predicted and observed TTFT/TPOT, the mean TPOT of each request, KV pages,
  worker restarts, and HTTP requests by route and status."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bullet.frontend.client import RequestState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
WORKER = ("model_name", "engine_type")


def gauge(name: str, doc: str, labels=()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class _RuntimeCollector:
    """Gauges and counters read at scrape time from what the workers publish."""

    def __init__(self, runtime, model_name: str, hit_rate):
        self.rt, self.model, self.hit_rate = runtime, model_name, hit_rate

    def collect(self):
        rt = self.rt
        up = gauge("bullet:up", "1 while the server is serving")
        up.add_metric([], 1.0 if rt.healthy else 0.0)
        restarts = gauge("bullet:worker_restarts", "worker restarts since the server started")
        restarts.add_metric([], rt.launcher.restarts)
        yield from (up, restarts)
        if rt.client is not None:
            inflight = gauge("bullet:inflight_requests", "requests accepted and not finished")
            inflight.add_metric([], len(rt.client.inflight))
            yield inflight
        state, alloc = rt.launcher.state, rt.launcher.allocator
        if state is None or alloc is None:
            return
        yield from self._workers(state, rt.launcher.roles)
        yield from self._pool(alloc)

    def _workers(self, state, roles):
        running = gauge("sglang:num_running_reqs", "requests in the worker's running batch", WORKER)
        queued = gauge("sglang:num_queue_reqs", "requests waiting in the worker's queue", WORKER)
        queued_tok = gauge("bullet:queued_tokens", "prompt tokens waiting for prefill", ["worker"])
        units = gauge("bullet:compute_units", "compute units (CPU cores / SMs) the worker holds", ["worker"])
        step = gauge("bullet:step_seconds", "duration of the worker's last step", ["worker"])
        ttft_pred = gauge("bullet:predicted_ttft_seconds", "predicted P90 TTFT of queued and running prefills",
                          ["worker"])
        tpot_pred = gauge("bullet:predicted_tpot_seconds", "predicted P90 TPOT of the running decode batch",
                          ["worker"])
        steps = CounterMetricFamily("bullet:steps", "steps the worker has run", labels=["worker"])
        decisions = CounterMetricFamily("bullet:decisions", "scheduling decisions the worker's policy has taken",
                                        labels=["worker"])
        repartitions = CounterMetricFamily("bullet:repartitions", "changes of the worker's compute share",
                                           labels=["worker"])
        for role in roles:
            ws = state.read(role.block)
            name = role.value
            running.add_metric([self.model, name], ws.batch_size)
            queued.add_metric([self.model, name], ws.queued_requests)
            queued_tok.add_metric([name], ws.queued_tokens)
            units.add_metric([name], ws.compute_units)
            step.add_metric([name], ws.step_obs_ms / 1e3)
            ttft_pred.add_metric([name], ws.ttft_pred_p90_ms / 1e3)
            tpot_pred.add_metric([name], ws.tpot_pred_p90_ms / 1e3)
            steps.add_metric([name], ws.step)
            decisions.add_metric([name], ws.decisions)
            repartitions.add_metric([name], ws.repartitions)
        yield from (running, queued, queued_tok, units, step, ttft_pred, tpot_pred, steps, decisions, repartitions)

    def _pool(self, alloc):
        total, free = alloc.total_pages, alloc.num_free()
        cached, evictable = alloc.cache_pages()
        used = total - free - evictable  # cached pages no request uses are as good as free (as in SGLang)
        used_tokens = gauge("sglang:num_used_tokens", "KV slots held by requests", ["model_name"])
        used_tokens.add_metric([self.model], used * alloc.page_size)
        usage = gauge("sglang:token_usage", "fraction of the KV pool in use", ["model_name"])
        usage.add_metric([self.model], used / total if total else 0.0)
        hit = gauge("sglang:cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens, over "
                    "finished requests", ["model_name"])
        hit.add_metric([self.model], self.hit_rate())
        pages_free = gauge("bullet:kv_pages_free", "free pages in the shared KV pool")
        pages_free.add_metric([], free)
        pages_total = gauge("bullet:kv_pages_total", "pages in the shared KV pool")
        pages_total.add_metric([], total)
        pages_cached = gauge("bullet:kv_pages_cached", "pages the prefix cache holds")
        pages_cached.add_metric([], cached)
        pages_evictable = gauge("bullet:kv_pages_evictable", "cached pages no request uses (evicted on demand)")
        pages_evictable.add_metric([], evictable)
        yield from (used_tokens, usage, hit, pages_free, pages_total, pages_cached, pages_evictable)


class Metrics:
    def __init__(self, runtime):
        self.registry = r = CollectorRegistry()
        self.model = runtime.model.model_name
        m = ["model_name"]
        self.requests = Counter("sglang:num_requests", "requests finished", m, registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "requests aborted (by a client or a failure)", m,
                               registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "generated tokens", m, registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "prompt tokens served from the prefix cache",
                                     m, registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "time to first token", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "time between token arrivals", m,
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "arrival to finish", m, buckets=LATENCY_BUCKETS,
                             registry=r)
        self.finished = Counter("bullet:requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.tpot = Histogram("bullet:time_per_output_token_seconds", "TPOT (mean per request)",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.http = Counter("bullet:http_requests", "HTTP requests by route and status", ["path", "status"],
                            registry=r)
        for counter in (self.requests, self.aborted, self.prompt_tokens, self.generation_tokens, self.cached_tokens):
            counter.labels(self.model)  # exported from the start, at 0
        self._prompt_total = self._cached_total = 0
        r.register(_RuntimeCollector(runtime, self.model, self.hit_rate))

    def hit_rate(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def on_finish(self, st: RequestState) -> None:
        kind = (st.finish_json or {}).get("type", "unknown")
        self.finished.labels(kind).inc()
        self.requests.labels(self.model).inc()
        if kind == "abort":
            self.aborted.labels(self.model).inc()
        self.prompt_tokens.labels(self.model).inc(len(st.prompt_ids))
        self.cached_tokens.labels(self.model).inc(st.cached_tokens)
        self._prompt_total += len(st.prompt_ids)
        self._cached_total += st.cached_tokens
        self.generation_tokens.labels(self.model).inc(len(st.output_ids))
        if st.first_token_time is not None:
            self.ttft.labels(self.model).observe(st.first_token_time - st.arrival)
            if len(st.output_ids) > 1 and st.finish_time is not None:
                self.tpot.observe((st.finish_time - st.first_token_time) / (len(st.output_ids) - 1))
        itl = self.itl.labels(self.model)
        for a, b in zip(st.token_times, st.token_times[1:]):
            itl.observe(b - a)
        if st.finish_time is not None:
            self.e2e.labels(self.model).observe(st.finish_time - st.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
