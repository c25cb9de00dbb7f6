"""Prometheus metrics: request and token counters, TTFT/TPOT/ITL/end-to-end histograms (recorded
as requests finish), and gauges read from the state buffer and allocator at scrape time (queues,
batch sizes, each worker's compute share, free KV pages, restarts)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from bullet.runtime.client import RequestState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)


class _RuntimeCollector:
    def __init__(self, runtime):
        self.rt = runtime

    def collect(self):
        rt = self.rt
        up = GaugeMetricFamily("bullet_up", "1 while the server is serving")
        up.add_metric([], 1.0 if rt.healthy else 0.0)
        yield up
        restarts = GaugeMetricFamily("bullet_worker_restarts", "worker restarts since start")
        restarts.add_metric([], rt.launcher.restarts)
        yield restarts
        if rt.client is not None:
            inflight = GaugeMetricFamily("bullet_inflight_requests", "requests accepted and not finished")
            inflight.add_metric([], len(rt.client.inflight))
            yield inflight
        state, alloc = rt.launcher.state, rt.launcher.allocator
        if state is None or alloc is None:
            return
        queued = GaugeMetricFamily("bullet_queued_requests", "requests waiting for prefill", labels=["worker"])
        queued_tok = GaugeMetricFamily("bullet_queued_tokens", "prompt tokens waiting for prefill", labels=["worker"])
        running = GaugeMetricFamily("bullet_running_requests", "requests in the worker's current batch", labels=["worker"])
        units = GaugeMetricFamily("bullet_compute_units", "compute units (cores / SMs) the worker holds", labels=["worker"])
        step = GaugeMetricFamily("bullet_step_seconds", "duration of the worker's last step", labels=["worker"])
        for role in ("prefill", "decode"):
            ws = state.read(role)
            queued.add_metric([role], ws.queued_requests)
            queued_tok.add_metric([role], ws.queued_tokens)
            running.add_metric([role], ws.batch_size)
            units.add_metric([role], ws.compute_units)
            step.add_metric([role], ws.step_obs_ms / 1e3)
        yield from (queued, queued_tok, running, units, step)
        free = GaugeMetricFamily("bullet_kv_pages_free", "free pages in the shared KV pool")
        free.add_metric([], alloc.num_free())
        total = GaugeMetricFamily("bullet_kv_pages_total", "pages in the shared KV pool")
        total.add_metric([], alloc.total_pages)
        yield free
        yield total


class Metrics:
    def __init__(self, runtime):
        self.registry = CollectorRegistry()
        r = self.registry
        self.finished = Counter("bullet_requests", "finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("bullet_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("bullet_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("bullet_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("bullet_time_per_output_token_seconds", "TPOT (mean per request)",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("bullet_inter_token_latency_seconds", "time between token arrivals",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("bullet_e2e_request_latency_seconds", "arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.http = Counter("bullet_http_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        r.register(_RuntimeCollector(runtime))

    def on_finish(self, st: RequestState) -> None:
        self.finished.labels((st.finish_json or {}).get("type", "unknown")).inc()
        self.prompt_tokens.inc(len(st.prompt_ids))
        self.generation_tokens.inc(len(st.output_ids))
        if st.first_token_time is not None:
            self.ttft.observe(st.first_token_time - st.arrival)
            if len(st.output_ids) > 1 and st.finish_time is not None:
                self.tpot.observe((st.finish_time - st.first_token_time) / (len(st.output_ids) - 1))
        for a, b in zip(st.token_times, st.token_times[1:]):
            self.itl.observe(b - a)
        if st.finish_time is not None:
            self.e2e.observe(st.finish_time - st.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
