"""``ComputeBaton``: one holder at a time, released only by its holder, around waits (no processes needed)."""

from __future__ import annotations

import threading

from splitgrad.parallel.expert.baton import ComputeBaton


def test_baton_hands_the_core_over_only_at_waits():
    """The main thread holds the baton; the worker can run only while the main thread is inside ``released()``
    and the main thread resumes only when the worker gives it back (event order, no timing)."""
    baton, order = ComputeBaton(log=[]), []
    started = threading.Event()

    def worker() -> None:
        started.set()
        baton.acquire()
        order.append("worker computes")
        with baton.released():  # its own wait: hands the baton back
            order.append("worker waits")
        order.append("worker resumes")
        baton.release()

    baton.acquire()
    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(10)
    order.append("main computes")  # the worker is blocked on acquire: the main thread holds the baton
    with baton.released():
        for _ in range(1000):  # the worker runs while the main thread "waits" (bounded: never hangs)
            if "worker waits" in order:
                break
            thread.join(0.01)
        assert "worker waits" in order, order
        order.append("main wait done")
    order.append("main resumes")
    baton.release()
    thread.join(10)
    assert not thread.is_alive()
    assert order.index("main computes") < order.index("worker computes") < order.index("worker waits")
    assert order.index("main resumes") > order.index("worker waits")
    assert baton.handoffs == 2
    assert len(baton.log) == 2 and all(start <= end for start, end in baton.log)  # one take-back per wait
    assert not baton.held()


def test_baton_released_is_a_no_op_without_it():
    """A thread that does not hold the baton (a layer's backward after the pair) waits as usual; a stray
    ``release()`` does not free another thread's baton."""
    baton = ComputeBaton()
    with baton.released():
        pass
    assert baton.handoffs == 0 and not baton.held()
    baton.acquire()
    result = []
    thread = threading.Thread(target=lambda: (baton.release(), result.append(baton._lock.locked())))
    thread.start()
    thread.join(10)
    assert result == [True]  # still held by the main thread
    assert baton.held()
    baton.release()
    assert not baton._lock.locked()
