"""Issue 11 item 4: one account of owed work, claims settled exactly once, runs safe against two threads.

Why: before, the store kept three counters changed from three classes, ``pending_wgrad(model)`` ignored
bundles while ``ensure_no_pending_wgrad`` counted them, and ``WgradBundle.pending`` /
``GraphedCallable.pending_wgrad`` meant other things again. Two threads could run one task twice (double
counting), and a capture opened from a second thread silently collected the first thread's work.
"""

from __future__ import annotations

import threading

import pytest
import torch

import splitgrad
from splitgrad.core import Outstanding, WgradTask
from splitgrad.testing import CpuGraphBackend
from tests.graphs.helpers import mlp, seeded
from tests.helpers import make_graphed


def test_outstanding_counts_queue_bundles_and_graph_replays_once():
    model = seeded(lambda: mlp(delay=True))
    other = splitgrad.Linear(6, 6, delay_wgrad_compute=True)
    x = torch.randn(3, 6)
    (graphed,) = make_graphed((model,), ((x,),), backend=CpuGraphBackend())
    graphed(x).sum().backward()  # one wgrad-graph replay owed per deferring layer
    whole = torch.nn.ModuleList([model, other])
    other(x).sum().backward()  # queued
    with splitgrad.capture_wgrad() as bundle:
        other(x).sum().backward()  # in a bundle
    out = splitgrad.outstanding_wgrad(whole)
    assert out == Outstanding(queued=1, in_bundles=1, in_graphs=graphed.pending_wgrad)
    assert graphed.pending_wgrad == len(list(splitgrad.split_modules(model))) >= 2  # one per deferring layer
    assert out.total == splitgrad.pending_wgrad(whole) == 2 + graphed.pending_wgrad
    assert splitgrad.queued_wgrad(whole) == 1 == len(other.wgrad_store)
    assert bundle.outstanding == 1 and bundle.pending
    graphed.backward_dw()
    bundle.run()
    other.backward_dw()
    assert splitgrad.outstanding_wgrad(whole) == Outstanding() and not splitgrad.outstanding_wgrad(whole)
    assert bundle.outstanding == 0 and not bundle.pending and graphed.pending_wgrad == 0
    splitgrad.ensure_no_pending_wgrad(whole)


def test_a_claim_is_settled_exactly_once():
    store = splitgrad.Linear(2, 2, delay_wgrad_compute=True).wgrad_store
    claim = store.owe()
    assert store.outstanding.in_graphs == 1
    claim.settle()
    assert store.outstanding.total == 0
    with pytest.raises(RuntimeError, match="settled twice"):
        claim.settle()
    assert store.outstanding.total == 0  # not driven negative


def _blocking_task(store, started: threading.Event, release: threading.Event, runs: list) -> WgradTask:
    def compute() -> None:
        started.set()
        release.wait(timeout=30)
        runs.append(1)

    return WgradTask(compute, store=store, label="blocking")


def test_a_task_cannot_run_twice_from_two_threads():
    layer = splitgrad.Linear(2, 2, delay_wgrad_compute=True)
    started, release, runs, errors = threading.Event(), threading.Event(), [], []
    task = _blocking_task(layer.wgrad_store, started, release, runs)
    layer.wgrad_store.defer(task)
    worker = threading.Thread(target=layer.backward_dw)
    worker.start()
    assert started.wait(timeout=30)
    try:
        layer.backward_dw()  # the same head task, already running in the worker
    except RuntimeError as err:
        errors.append(str(err))
    release.set()
    worker.join(timeout=30)
    assert runs == [1] and len(errors) == 1 and "is running" in errors[0]
    assert splitgrad.pending_wgrad(layer) == 0


def test_a_bundle_cannot_run_twice_from_two_threads():
    layer = splitgrad.Linear(2, 2, delay_wgrad_compute=True)
    started, release, runs = threading.Event(), threading.Event(), []
    with splitgrad.capture_wgrad() as bundle:
        layer.wgrad_store.defer(_blocking_task(layer.wgrad_store, started, release, runs))
    worker = threading.Thread(target=bundle.run)
    worker.start()
    assert started.wait(timeout=30)
    with pytest.raises(RuntimeError, match="is running"):
        bundle.run()
    with pytest.raises(RuntimeError, match="is running"):
        bundle.discard()
    release.set()
    worker.join(timeout=30)
    assert runs == [1] and bundle.outstanding == 0 and splitgrad.pending_wgrad(layer) == 0


def test_capture_from_a_second_thread_is_refused_while_one_is_open():
    errors: list[str] = []

    def other_thread() -> None:
        try:
            with splitgrad.capture_wgrad():
                pass
        except RuntimeError as err:
            errors.append(str(err))

    with splitgrad.capture_wgrad():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join(timeout=30)
    assert len(errors) == 1 and "while thread" in errors[0]
    # Once closed, another thread may capture.
    errors.clear()
    t = threading.Thread(target=other_thread)
    t.start()
    t.join(timeout=30)
    assert errors == []
