"""The scheduler profile of perf.py's streaming part splits py-spy samples by phase."""

from __future__ import annotations

from benchmarks.scheduler_phases import phases

LOOP = "run_scheduler_process (s.py:1);event_loop_normal (s.py:2)"


def test_samples_are_split_by_the_first_marked_phase(tmp_path) -> None:
    raw = tmp_path / "sample.pyspy"
    raw.write_text("\n".join([
        f"{LOOP};run_batch (s.py:3);_execute_extend (m.py:4);get_image_feature (q.py:5) 6",
        f"{LOOP};run_batch (s.py:3);_execute_extend (m.py:4);Qwen2Attention.forward (q.py:9) 2",
        f"{LOOP};run_batch (s.py:3);_execute_decode (m.py:6) 1",
        f"{LOOP};process_batch_result (s.py:7);around_checkpoint_kv_cache (h.py:1);"
        "on_checkpoint (c.py:8) 1",
        f"{LOOP};recv_requests (s.py:9) 0",  # a phase with no samples is listed at 0
        "Thread._bootstrap (threading.py:1);WatchdogRaw._watchdog_thread (w.py:2) 50",
    ]) + "\n")
    assert phases(raw) == {"vision encoder": 0.6, "prefill forward": 0.2, "decode forward": 0.1,
                           "compression": 0.1, "idle": 0.0}
