"""The test servers of all pytest-xdist workers stay within one budget of scheduler units
(``tests/support/budget.py``): a worker stops its own servers first, then waits for another
worker to give some back between its tests."""

from __future__ import annotations

import threading

from tests.support.budget import Budget


class Worker:
    """A worker's servers, least recently used first: (name, units, kept for the session)."""

    def __init__(self, root, name: str, servers: list[tuple[str, int, bool]], total: int = 5):
        self.budget = Budget(root, name, total)
        self.servers = list(servers)
        self.stopped: list[str] = []

    def held(self) -> int:
        return sum(units for _, units, _ in self.servers)

    def stop_one(self, kept: bool) -> bool:
        for server in self.servers:
            if server[2] == kept:
                self.servers.remove(server)
                self.stopped.append(server[0])
                return True
        return False

    def acquire(self, units: int) -> None:
        self.budget.acquire(units, self.held, self.stop_one)
        self.servers.append(("new", units, False))


def test_one_process_stops_what_it_need_not_keep_and_keeps_the_shared_servers():
    worker = Worker(None, "main", [("a", 1, False), ("stock", 1, True), ("b", 1, False),
                                   ("identity", 1, True), ("compressing", 1, True)])
    worker.acquire(3)
    assert worker.stopped == ["a", "b"]  # least recently used first, the kept ones stay
    assert worker.held() == 6  # over the total: no other worker needs the room


def test_a_worker_stops_its_own_servers_to_fit_beside_another(tmp_path):
    other = Worker(tmp_path, "gw1", [])
    other.acquire(2)
    worker = Worker(tmp_path, "gw0", [("stock", 1, True), ("a", 1, False), ("b", 1, False)])
    worker.acquire(2)
    assert worker.stopped == ["a", "b"]
    assert worker.held() + other.held() == 5


def test_a_worker_with_nothing_left_to_stop_waits_for_the_other_to_give_back(tmp_path):
    other = Worker(tmp_path, "gw1", [])
    other.acquire(5)
    worker = Worker(tmp_path, "gw0", [("stock", 1, True)])
    started = threading.Thread(target=worker.acquire, args=(2,))
    started.start()
    started.join(3.0)
    assert started.is_alive()  # waiting: its own kept server went first, and that was not enough
    assert worker.stopped == ["stock"]
    other.budget.yield_to_waiting(other.held, other.stop_one)  # the other worker's test ended
    started.join(10.0)
    assert not started.is_alive()
    assert other.held() + worker.held() <= 5
    other.budget.yield_to_waiting(other.held, other.stop_one)  # nobody waits: nothing stops
    assert other.held() == 0 and worker.held() == 2
