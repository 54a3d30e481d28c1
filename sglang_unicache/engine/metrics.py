"""Prometheus metrics of the plugin on SGLang's ``/metrics`` (with ``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode; metrics created in the scheduler process
after it set ``PROMETHEUS_MULTIPROC_DIR`` are served by the HTTP server with its own. The
controller's counters (``Controller.counters``) stay the single source of truth: ``sync`` turns
their growth since the last call into counter increments, once per scheduled batch; gauges are
set to the value the caller read. Only tensor-parallel rank 0 of each replica exports, so with
``--dp-size`` the counters and the gauges (``livesum``) add up over the data-parallel ranks.
"""

from __future__ import annotations

COUNTERS = {
    "images_compressed": "Image spans compressed after prefill",
    "slots_freed": "KV slots returned to the allocator by compaction",
    "spans_reused": "Compressed image spans served from the radix tree to a later request",
    "spans_recalled": "Images a later request got back in full from their host copy",
    "recall_history_tokens": "Tokens after a recalled image copied from the device path",
    "recall_bytes": "Host copy bytes loaded back onto the device for recalls",
    "recall_lost": "Recalls whose host copy or room was gone at admission: prefilled instead",
    "host_copies_stored": "Full image spans copied to host memory when compressed",
    "host_copies_evicted": "Host copies dropped for the host byte budget (least recently used)",
    "fallbacks": "Requests whose self-check failed at the escalation cap; full KV kept",
    "escalations": "Keep-ratio rungs climbed after a failed self-check",
    "views_unchecked": "Requests whose view was planned at the top of its bounded ladder "
                       "(view_max_keep): decoded without a self-check",
    "requests_parked": "Compressing requests that sat out one batch (overlap_compression) "
                       "instead of that batch waiting for their compression",
    "errors": "Compressions that raised an error (on any tensor-parallel rank); full KV kept",
    "capture_missed": "Prefills whose attention ran past the query hook; full KV kept",
    "rank_disagreements": "Compressions the tensor-parallel ranks did not do alike",
    "images_prefilled": "Image spans computed by a prefill (the vision encoder ran for them)",
    "skipped_cached": "Images left uncompressed because part of them came from the tree",
    "spans_recompressed": "Cached compressed spans shrunk under memory pressure instead of evicted",
    "recompress_slots_freed": "KV slots returned to the allocator by re-compression (under "
                              "memory pressure and at rest)",
    "spans_shrunk_at_rest": "Escalated spans back at the keep ratio once unused (a host copy "
                            "serves later questions)",
    "spans_loaded_back": "Compressed spans loaded back from HiCache's host tier for a request",
    "load_back_waits": "Rounds a request with compressed spans on the host waited for room",
}
GAUGES = {
    "host_copies": "Full image spans held in host memory now",
    "host_copy_bytes": "Bytes the host copies hold now",
    "compressed_slots_held": "KV slots the radix tree's compressed image spans hold now",
    "spans_on_host": "Compressed image spans held only in HiCache's host tier now",
}


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.counters = {name: Counter(f"sglang_unicache_{name}", doc)
                         for name, doc in COUNTERS.items()}
        self.seen = dict.fromkeys(COUNTERS, 0)
        self.gauges = {name: Gauge(f"sglang_unicache_{name}", doc,
                                   multiprocess_mode="livesum")
                       for name, doc in GAUGES.items()}

    def sync(self, counters: dict[str, float], gauges: dict[str, float] | None = None) -> None:
        for name, value in (gauges or {}).items():
            self.gauges[name].set(value)
        for name, counter in self.counters.items():
            value = counters[name]
            if value > self.seen[name]:
                counter.inc(value - self.seen[name])
                self.seen[name] = value
