"""``WgradTask``: one backward's worth of deferred weight-gradient work, run exactly once."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import torch

from .profiling import profiler_active
from .store import WeightGradStore, WgradClaim

__all__ = ["WgradTask"]


class WgradTask:
    """One backward's worth of deferred weight-gradient work for one owner.

    A task is owed from the moment it is parked until it ran (or was discarded on purpose). Running it is
    safe against double runs, also from two threads at once, and a task whose ``compute`` raises stays owed
    (where it was: queue or bundle), so a retry after fixing the cause runs it.

    Args:
        compute: writes the gradients (``.grad`` or ``main_grad``); must check everything it needs before
            writing anything, so that a failure leaves no gradient half written.
        store: the owner's store; its hooks fire after ``compute`` and its account is kept.
        label: shown in errors and profiler ranges (usually the owner's name), or a function returning it,
            called only when it is shown (a task is made per backward: formatting a name each time costs).
        saved: tensors ``compute`` reads; their version counters are recorded now and checked before
            running, so an in-place change between backward and ``backward_dw`` is an error, not a silently
            wrong gradient.
        finish: called once after the hooks fired (also when one raised, and right after ``compute`` with
            ``fire_hooks=False``): takes back what ``compute`` left for the hooks only (the placeholder
            ``.grad`` of :mod:`splitgrad.core.placeholder`).
    """

    __slots__ = ("_compute", "_finish", "_holder", "_label", "_lock", "_state", "_versions", "store")

    def __init__(
        self,
        compute: Callable[[], None],
        *,
        store: WeightGradStore,
        label: str | Callable[[], str] = "",
        saved: Sequence[torch.Tensor] = (),
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._compute = compute
        self._finish = finish
        self.store = store
        self._label = label or store.name
        self._versions = [(t, t._version) for t in saved]
        self._state = "pending"  # pending -> running -> done | back to pending on failure; or discarded
        self._lock = threading.Lock()
        # What owes this task: the store's queue, a bundle's claim, or None (popped: the caller owns it).
        self._holder: WeightGradStore | WgradClaim | None = None

    @property
    def label(self) -> str:
        """The owner's name, as given (formatted on first use when given as a function)."""
        if callable(self._label):
            self._label = self._label()
        return self._label

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def owed(self) -> bool:
        """Neither ran nor was discarded."""
        return self._state in ("pending", "running")

    @property
    def saved_bytes(self) -> int:
        """Bytes of the distinct storages this task keeps alive until it runs (0 once it ran)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t, _ in self._versions}
        return sum(storages.values())

    def run(self, *, fire_hooks: bool = True) -> None:
        """Compute and write the gradients, settle the task where it was owed, then fire the owner's hooks.

        Args:
            fire_hooks: ``False`` leaves hook firing to the caller (a graph capture records the gradient
                math only and fires the hooks itself after each replay).

        Raises:
            RuntimeError: the task already ran, was discarded, is running in another thread, or a saved
                operand was modified in place since backward (the task then stays owed).
        """
        with self._lock:
            if self._state != "pending":
                why = {"done": "already ran", "discarded": "was discarded", "running": "is running"}[
                    self._state
                ]
                raise RuntimeError(
                    f"wgrad task of {self.label!r} {why}; running it again would double-count"
                    if self._state != "discarded"
                    else f"wgrad task of {self.label!r} was discarded; its gradient was given up on purpose"
                )
            self._state = "running"
        try:
            self._check_versions()
            # No grad mode: saved operands can be views of tensors that require grad (a view made inside
            # backward still does), and recording their W math would attach a grad_fn to `.grad`/`main_grad`.
            with (
                torch.no_grad(),
                # A named range only while a profiler records (opening one costs more than a small W).
                (
                    torch.profiler.record_function(f"splitgrad.wgrad:{self.label}")
                    if profiler_active()
                    else contextlib.nullcontext()
                ),
                contextlib.ExitStack() as around,
            ):
                for factory in getattr(self.store, "compute_contexts", ()):
                    around.enter_context(factory())
                self._compute()
        except BaseException:
            with self._lock:
                self._state = "pending"  # still owed where it was: a retry after fixing the cause runs it
            raise
        with self._lock:
            self._state = "done"
        # Drop operands as soon as possible: they are activation-sized.
        self._compute = _ran
        self._versions = []
        self._settle()
        finish, self._finish = self._finish, None
        try:
            if fire_hooks:
                self.store.hooks.fire()
        finally:
            if finish is not None:
                finish()

    def _check_versions(self) -> None:
        for i, (tensor, version) in enumerate(self._versions):
            if tensor._version != version:
                raise RuntimeError(
                    f"wgrad task of {self.label!r}: saved tensor {i} (shape {tuple(tensor.shape)}) was modified "
                    f"in place after backward (version {version} -> {tensor._version}); its weight gradient "
                    "would be wrong. Restore the tensor and run it again, or discard the work"
                )

    def _settle(self) -> None:
        holder, self._holder = self._holder, None
        if isinstance(holder, WeightGradStore):
            holder._settle_queued(self)
        elif isinstance(holder, WgradClaim):
            holder.settle()

    def _mark_discarded(self) -> None:
        """Given up on purpose by its holder (``store.clear()``, ``bundle.discard()``)."""
        with self._lock:
            if self._state == "running":
                raise RuntimeError(f"wgrad task of {self.label!r} is running; it cannot be discarded now")
            if self._state != "pending":
                return
            self._state = "discarded"
        self._compute = _ran
        self._finish = None
        self._versions = []
        holder, self._holder = self._holder, None
        if isinstance(holder, WgradClaim):
            holder.settle()

    def __repr__(self) -> str:
        return f"WgradTask({self.label!r}, state={self._state})"


def _ran() -> None:
    raise RuntimeError("wgrad task already ran")
