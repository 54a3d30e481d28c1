"""SGLang's overlap scheduler with compression: a prefill with compression targets has its result
processed before the next batch is built, in order, and exactly once.

The overlap loop (on by default, kept on by ``--unicache``) builds the next batch before it
processes the last one's result. Compaction must come first, or the next decode would allocate
each request's slot at its uncompacted length. So when results of compressing prefills wait in
the queue, ``drain`` processes every queued result up to the last of them, in queue order, before
the build; the loop still pops those entries later, and ``already_processed`` tells it to skip
them. Only the step after a compressing prefill loses the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _holds(results: list, result: Any) -> bool:
    """Whether ``result`` is in ``results`` (by identity: results do not compare by value)."""
    return any(r is result for r in results)


def _take(results: list, result: Any) -> bool:
    """Remove ``result`` from ``results`` (by identity); whether it was there."""
    for i, r in enumerate(results):
        if r is result:
            del results[i]
            return True
    return False


@dataclass
class OverlapDrain:
    # Results of extend batches with compression targets, not yet processed, and results
    # processed ahead of the loop, oldest first.
    compressing: list = field(default_factory=list)
    processed_early: list = field(default_factory=list)

    def compresses(self, result: Any) -> None:
        """``result`` is a prefill's with compression targets."""
        self.compressing.append(result)

    def drain(self, scheduler: Any) -> None:
        """Before the next batch is built: process every queued result up to the last
        compressing one."""
        if not self.compressing:
            return
        queue = scheduler.result_queue or ()
        waiting = [entry for entry in queue if not _holds(self.processed_early, entry[1])]
        last = max((i for i, (_, result) in enumerate(waiting)
                    if _holds(self.compressing, result)), default=-1)
        for batch, result in waiting[:last + 1]:  # in order: results are processed in order
            scheduler.process_batch_result(batch, result)
            self.processed_early.append(result)
            # The loop still pops this entry (and skips it). Until then SGLang reads the queued
            # batch's requests as ones whose next token is not yet committed, and skips the
            # decode of those it would finish by length; these have committed theirs.
            batch.reqs = []

    def already_processed(self, result: Any) -> bool:
        """The loop pops ``result``: True if ``drain`` processed it (skip it now)."""
        if _take(self.processed_early, result):
            return True
        _take(self.compressing, result)
        return False
