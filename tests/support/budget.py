"""Scheduler units alive at once, across the pytest-xdist workers of one run.

A unit is one scheduler process (a server runs ``--dp-size`` x ``--tp-size`` of them) and costs
about 2.7 GB of RAM here, so the units of every worker together must stay under one total. Each
worker writes the units it holds, and the units it is waiting for, to its own file in a directory
the workers share; reads and writes happen under one file lock.

A worker that needs room stops its own least recently used servers first. When it holds nothing
more it can stop, it waits: every worker gives back servers at the end of each test while another
waits (``Budget.yield_to_waiting``), so the wait ends as soon as the other worker's test does.
A single process (no xdist) has no one to wait for and goes over the total instead of stopping the
servers kept for the whole session.
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

WAIT_S = 900.0  # a wait longer than any test: then the start goes ahead over the total


class Budget:
    def __init__(self, root: Path | None, worker: str, total: int):
        self.root, self.worker, self.total = root, worker, total
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self.root is None:
            yield
            return
        with open(self.root / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _others(self) -> tuple[int, int]:
        """(units the other workers hold, units they wait for)."""
        held = waiting = 0
        if self.root is None:
            return held, waiting
        for path in self.root.glob("*.json"):
            if path.stem != self.worker:
                state = json.loads(path.read_text())
                held, waiting = held + state["held"], waiting + state["waiting"]
        return held, waiting

    def _publish(self, held: int, waiting: int = 0) -> None:
        if self.root is not None:
            path = self.root / f"{self.worker}.json"
            path.with_suffix(".tmp").write_text(json.dumps({"held": held, "waiting": waiting}))
            path.with_suffix(".tmp").replace(path)

    def acquire(self, units: int, held: Callable[[], int],
                stop_one: Callable[[bool], bool]) -> None:
        """Make room for ``units`` more: ``held()`` is what this worker holds now, and
        ``stop_one(kept)`` stops its least recently used server (``kept`` False: only those not
        kept for the session) and says whether there was one. Returns once the units fit; the
        caller then counts them in ``held()``."""
        deadline = time.monotonic() + WAIT_S
        while True:
            with self._locked():
                others, _ = self._others()
                if held() + units + others <= self.total:
                    self._publish(held() + units)
                    return
                if stop_one(False):
                    self._publish(held())
                    continue
                if self.root is None or others == 0:  # only our own kept servers are left
                    self._publish(held() + units)
                    return
                if stop_one(True):
                    self._publish(held())
                    continue
                if time.monotonic() > deadline:
                    self._publish(held() + units)
                    return
                self._publish(held(), waiting=units)
            time.sleep(1.0)

    def yield_to_waiting(self, held: Callable[[], int], stop_one: Callable[[bool], bool]) -> None:
        """Between tests: stop servers while another worker waits for room."""
        if self.root is None:
            return
        with self._locked():
            while True:
                others, waiting = self._others()
                if not waiting or held() + others + waiting <= self.total:
                    break
                if not (stop_one(False) or stop_one(True)):
                    break
            self._publish(held())

    def leave(self) -> None:
        """This worker holds nothing any more."""
        with self._locked():
            self._publish(0)
