"""Scheduler counters and gauges -> metric updates (deltas since the previous round)."""
from __future__ import annotations


from helios_backend.scheduler.scheduler import Scheduler
from helios_backend.engine.metrics import FAMILIES, FINISH_LABEL, OPERATION_LABEL, Kind, Op, Update, update


class RoundMetrics:
    def __init__(self, scheduler: Scheduler) -> None:
        self._s = scheduler
        self._last: dict[tuple[str, str], float] = {}
        self._gauges: dict[tuple[str, str], float] = {}

    def capacity(self) -> list[Update]:
        """Startup: capacities, and every unlabeled counter at 0 so each family is exposed."""
        s = self._s
        zeros = [update(f.name, Op.ADD, 0) for f in FAMILIES if f.kind is Kind.COUNTER and not f.labels]
        return zeros + [update("flare_cache_pages_capacity", Op.SET, s.pool.num_pages),
                update("flare_request_slots_capacity", Op.SET, s.config.request_slots),
                update("flare_snapshot_rows_capacity", Op.SET, s.snapshots.capacity),
                update("flare_constrained_max_inflight", Op.SET, 0),
                update("flare_kv_cache_usage_ratio", Op.SET, 0), update("flare_prefix_cache_hit_ratio", Op.SET, 0)]

    def collect(self) -> list[Update]:
        s, c = self._s, self._s.counters
        out: list[Update] = []
        counters: list[tuple[str, str, str, float]] = [
            ("flare_requests_admitted_total", "", "", c.admitted),
            ("flare_requests_failed_total", "", "", c.failed),
            ("flare_preemptions_total", "", "", c.preemptions),
            ("flare_readmissions_total", "", "", c.readmissions),
            ("flare_generated_tokens_total", "", "", c.generated_tokens),
            ("flare_prefix_lookup_tokens_total", "", "", c.lookup_tokens),
            ("flare_prefix_reused_tokens_total", "", "", c.reused_tokens),
            ("flare_prefix_hit_pages_total", "", "", s.pool.counters.hit_pages),
            ("flare_cache_pages_published_total", "", "", s.pool.counters.published),
            ("flare_cache_pages_evicted_total", "", "", s.pool.counters.evictions),
            ("flare_snapshots_published_total", "", "", s.snapshots.counters.published),
            ("flare_snapshots_evicted_total", "", "", s.snapshots.counters.evicted),
            ("flare_snapshots_restored_total", "", "", s.snapshots.counters.restored),
            ("flare_mixed_grammar_decode_steps_total", "", "", c.mixed_grammar_decode_steps),
            ("flare_second_frame_rounds_total", "", "", c.pipelined),
        ]
        counters += [("flare_graph_launches_total", "operation", OPERATION_LABEL[op], n)
                     for op, n in c.launches.items()]
        counters += [("flare_requests_finished_total", "reason", FINISH_LABEL[r], n)
                     for r, n in c.finished.items()]
        for name, label, value, total in counters:
            key = (name, value)
            delta = total - self._last.get(key, 0)
            if delta:
                self._last[key] = total
                out.append(update(name, Op.ADD, delta, **({label: value} if label else {})))
        gauges: list[tuple[str, str, str, float]] = [
            ("flare_requests_waiting", "", "", s.waiting),
            ("flare_requests_running", "", "", s.running),
            ("flare_cache_pages", "state", "free", s.pool.free_pages),
            ("flare_cache_pages", "state", "used", s.pool.request_pages),
            ("flare_cache_pages", "state", "snapshot", s.pool.used_pages - s.pool.request_pages),
            ("flare_cache_pages", "state", "cached", s.pool.cached_pages),
            ("flare_snapshot_rows", "", "", s.snapshots.used_rows),
        ]
        pool = s.pool
        gauges.append(("flare_kv_cache_usage_ratio", "", "", pool.used_pages / pool.num_pages if pool.num_pages else 0.0))
        if c.lookup_tokens:
            gauges.append(("flare_prefix_cache_hit_ratio", "", "", c.reused_tokens / c.lookup_tokens))
        if c.first_admission_waits_ns:
            out += [update("flare_request_queue_time_seconds", Op.OBSERVE, wait / 1e9)
                    for wait in c.first_admission_waits_ns]
            c.first_admission_waits_ns.clear()
        if c.constrained_max_inflight:
            gauges.append(("flare_constrained_max_inflight", "", "", c.constrained_max_inflight))
        for name, label, value, level in gauges:
            key = (name, value)
            if self._gauges.get(key) != level:
                self._gauges[key] = level
                out.append(update(name, Op.SET, level, **({label: value} if label else {})))
        return out
