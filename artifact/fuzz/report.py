"""The fuzz/soak run's verdict and its Markdown: the headline numbers the issue asks for (crashes,
lost requests, leaked pages and segments), then each phase's table and every finding with examples."""

from __future__ import annotations


def verdict(result: dict) -> dict:
    """The numbers that must be zero, each with what it counts."""
    http, zmq_, soak = result.get("http") or {}, result.get("zmq") or {}, result.get("soak") or {}
    end = result.get("end") or {}
    restarts = (end.get("pool") or {}).get("worker_restarts")
    pool = end.get("pool") or {}
    free, total = pool.get("kv_pages_free"), pool.get("kv_pages_total")
    left = result.get("after_stop") or {}
    failed_probes = sum(1 for p in http.get("probes", []) + zmq_.get("probes", []) if not p.get("alive"))
    return {
        "worker_restarts": restarts,
        "server_died": bool(result.get("server_died")),
        "failed_liveness_probes": failed_probes,
        "code_executed_from_socket": bool(zmq_.get("code_executed")),
        "http_5xx": sum(n for s, n in (http.get("statuses") or {}).items() if int(s) >= 500),
        "http_timeouts_and_dropped": sum((http.get("failures") or {}).get(k, {}).get("count", 0)
                                         for k in ("timeout", "conn-error")),
        "soak_lost": soak.get("lost"), "soak_failed": soak.get("failed"), "soak_5xx": soak.get("status_5xx"),
        # a page the prefix cache keeps but nothing references is not leaked: it is evicted on demand
        "kv_pages_leaked": (total - free - (pool.get("kv_pages_evictable") or 0))
        if free is not None and total is not None else None,
        "requests_in_flight_at_end": pool.get("inflight_requests"),
        "shm_segments_left": len(left.get("shm_segments", [])) if left else None,
        "processes_left": len(left.get("processes_left", [])) if left else None,
        "runtime_dir_left": left.get("runtime_dir_left") if left else None,
    }


def _table(rows: list[tuple], head: tuple) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _memory_rows(result: dict) -> list[tuple]:
    points = [(k, result.get(k, {}).get("memory") or {}) for k in ("start", "soak_start", "end")]
    names = sorted({n for _, m in points for n in m})
    rows = []
    for name in names:
        cells = [f"{m[name]['rss_mib']:.0f} / {m[name]['pss_mib'] or 0:.0f}" if name in m else "-" for _, m in points]
        rows.append((name, *cells))
    return rows


def _recoveries(probes: list[dict]) -> list[str]:
    failed = [p for p in probes if not p.get("alive")]
    if not failed:
        return []
    cells = [f"after {p.get('after_case', p.get('after_message'))}: "
             + (f"back after {p['recovered_after_s']:g} s" if p.get("recovered_after_s") is not None else "did not recover")
             for p in failed]
    return ["Failed liveness probes and recovery: " + "; ".join(cells), ""]


def _findings(title: str, findings: dict) -> list[str]:
    if not findings:
        return [f"{title}: none."]
    lines = [f"{title}:", ""]
    for kind, f in findings.items():
        lines.append(f"* **{kind}** × {f['count']}")
        lines += [f"  * `{e[:400]}`" for e in f["examples"]]
    return lines


def markdown(result: dict) -> str:
    v = verdict(result)
    args = result["args"]
    lines = [f"# Fuzz and soak: {result['name']}", "",
             f"`{result['command']}` — {result['started_utc']} UTC, {result['wall_s'] / 60:.1f} minutes; server: "
             f"{result.get('server', 'given by --url')}; machine: {result.get('machine', '?')}.", "",
             "## Verdict (every number here should be 0 / false)", "",
             *_table([(k, "-" if x is None else x) for k, x in v.items()], ("what", "value")), ""]
    http = result.get("http")
    if http:
        cats = sorted(http["outcomes"])
        kinds = sorted({o for c in cats for o in http["outcomes"][c]})
        rows = [(c, sum(http["outcomes"][c].values()), *[http["outcomes"][c].get(k, 0) for k in kinds]) for c in cats]
        lines += [f"## HTTP fuzz: {http['sent']} requests in {http['wall_s'] / 60:.1f} minutes"
                  f"{' (stopped early: ' + http['stopped_early'] + ')' if http['stopped_early'] else ''}", "",
                  *_table(rows, ("category", "sent", *kinds)), "",
                  "Statuses: " + ", ".join(f"{s}: {n}" for s, n in http["statuses"].items()), "",
                  *_findings("Failures", http["failures"]), "", *_recoveries(http["probes"]),
                  *_findings("Bad input accepted with a 2xx (lenient, not failures)", http["lenient"]), ""]
    zmq_ = result.get("zmq")
    if zmq_:
        stop = f" (stopped early: {zmq_['stopped_early']})" if zmq_.get("stopped_early") else ""
        lines += [f"## Local sockets: {zmq_['total_sent']} messages in {zmq_['wall_s'] / 60:.1f} minutes{stop}", "",
                  "Delivered per socket: " + ", ".join(f"{k}: {n}" for k, n in zmq_["sent"].items()) +
                  (f"; undeliverable: {zmq_['undeliverable']}" if zmq_["undeliverable"] else ""), "",
                  "Payloads: " + ", ".join(f"{k}: {n}" for k, n in zmq_["categories"].items()), "",
                  f"Code executed from a message (canary pickle): **{zmq_['code_executed']}**.", "",
                  *_findings("Failures", zmq_["failures"]), "", *_recoveries(zmq_["probes"])]
    soak = result.get("soak")
    if soak:
        lines += [f"## Soak: {args['soak_minutes']:g} minutes at {args['soak_rate']:g} req/s", "",
                  *_table([(soak["sent"], soak["completed"], soak["failed"], soak["lost"], soak["status_4xx"],
                            soak["status_5xx"], f"{soak['latency_p50_s']:.2f}", f"{soak['latency_p90_s']:.2f}",
                            f"{soak['latency_max_s']:.2f}", soak["output_tokens"])],
                          ("sent", "completed", "failed", "lost", "4xx", "5xx", "p50 s", "p90 s", "max s",
                           "output tokens")), "",
                  "Endpoints: " + ", ".join(f"{k}: {n}" for k, n in soak["endpoints"].items()), "",
                  *_findings("Failures", soak["failures"]), ""]
    mem = _memory_rows(result)
    if mem:
        lines += ["## Memory (RSS / PSS, MiB) of every server process", "",
                  *_table(mem, ("process", "start", "soak start", "end")), ""]
    end = result.get("end") or {}
    lines += ["## At the end", "", f"Pool after the last request: {end.get('pool')}", "",
              f"After the server stopped (exit code {result.get('exit_code')}): {result.get('after_stop')}", ""]
    return "\n".join(lines)
