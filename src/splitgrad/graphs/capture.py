"""Capturing one (callable, microbatch): warm-up, then the forward, backward and wgrad graphs.

The backward graph is ``torch.autograd.grad`` of the static outputs with respect to the static inputs and the
parameters, run inside ``splitgrad.capture_wgrad(defer_requested=True)``: the input gradients and every weight
gradient that is not deferred are recorded in it, while each deferred weight gradient is parked as a task in the
bundle (``defer_requested``: although ``autograd.grad`` asks for it, the wgrad graph is what writes it). The
wgrad graph then records ``task.run(fire_hooks=False)`` of those tasks — their gradient math only. Hooks are
muted throughout (see :mod:`splitgrad.graphs.targets`) and fired by the replaying code instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..core import WeightGradStore, WgradBundle, capture_wgrad, split_modules
from .backend import GraphBackend
from .errors import GraphCaptureError
from .graphed import CapturedGraphs, GraphedCallable
from .targets import GradTarget, muted_hooks

__all__ = ["Owners", "UnitCapture", "warmup_once"]

logger = logging.getLogger(__name__)


class Owners:
    """The split-capable owners (modules and ops holding a ``wgrad_store``) of one callable, one per store.

    Found with :func:`splitgrad.split_modules`, so anything honouring the store contract counts.
    A plain function has none: its closed-over layers cannot be found (pass an ``nn.Module`` instead).
    """

    def __init__(self, fn: object) -> None:
        self.modules: dict[int, tuple[str, nn.Module]] = {}
        self.param_names: dict[int, str] = {}
        if isinstance(fn, nn.Module):
            for name, module in split_modules(fn):
                self.modules.setdefault(id(module.wgrad_store), (name, module))
            self.param_names = {id(p): n for n, p in fn.named_parameters()}

    @property
    def stores(self) -> list[WeightGradStore]:
        return [m.wgrad_store for _, m in self.modules.values()]

    def defers(self) -> bool:
        """Whether any owner defers now (then the callable gets a wgrad graph)."""
        return any(store.delay_wgrad_compute() for store in self.stores)

    def delay_flags(self) -> tuple[tuple[WeightGradStore, bool], ...]:
        return tuple((store, store.delay_wgrad_compute()) for store in self.stores)

    def params_of(self, stores: Sequence[WeightGradStore]) -> list[nn.Parameter]:
        """``get_backward_dw_params()`` of the owners of ``stores``, in module order, without duplicates."""
        wanted = {id(s) for s in stores}
        params: list[nn.Parameter] = []
        seen: set[int] = set()
        for key, (_, module) in self.modules.items():
            if key in wanted:
                for p in module.get_backward_dw_params():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        return params

    def candidates(self) -> list[nn.Parameter]:
        """Every parameter some owner may write itself (deferred or fused), deferring now or not."""
        return self.params_of(self.stores)

    def name_of(self, param: nn.Parameter) -> str:
        return self.param_names.get(id(param), f"parameter{tuple(param.shape)}")


def _as_tuple(result: object, label: str) -> tuple[tuple[torch.Tensor, ...], type | None]:
    if isinstance(result, torch.Tensor):
        return (result,), None
    if isinstance(result, (tuple, list)) and result and all(isinstance(r, torch.Tensor) for r in result):
        return tuple(result), type(result)
    raise GraphCaptureError(
        f"{label}: a graphed callable must return a tensor or a non-empty tuple/list of tensors, "
        f"got {type(result).__name__}"
    )


def _backward_wrt(inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    return [x for x in inputs if x.requires_grad] + list(params)


def warmup_once(
    fn: Callable[..., object], inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter], owners: Owners
) -> None:
    """One eager forward + backward + deferred wgrad, the way capture will run them, hooks muted."""
    with muted_hooks(owners.stores), capture_wgrad(defer_requested=True) as bundle:
        try:
            outputs, _ = _as_tuple(fn(*inputs), f"{type(fn).__name__} warm-up")
            diff = [o for o in outputs if o.requires_grad]
            wrt = _backward_wrt(inputs, params)
            if diff and wrt:
                torch.autograd.grad(diff, wrt, [torch.zeros_like(o) for o in diff], allow_unused=True)
            for task in bundle.tasks:
                task.run(fire_hooks=False)
        except BaseException:
            bundle.discard()  # a failed warm-up must not leave owed wgrad work in the owners' counts
            raise


def _untracked_leaves(outputs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Shapes of the autograd leaves behind ``outputs`` that require grad but are not in ``wrt``."""
    known = {id(t) for t in wrt}
    strays: list[tuple[int, ...]] = []
    seen: set[int] = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in known:
            strays.append(tuple(leaf.shape))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return strays


def _static_copy(sample: torch.Tensor) -> torch.Tensor:
    return sample.detach().clone().requires_grad_(sample.requires_grad)


class UnitCapture:
    """Builds the graphs of one (callable, microbatch) step by step, in the order the caller chooses."""

    def __init__(
        self,
        fn: Callable[..., object],
        sample_args: Sequence[torch.Tensor],
        *,
        owners: Owners,
        label: str,
        stage: int,
        microbatch: int,
        allow_unused_input: bool,
    ) -> None:
        self.fn = fn
        self.owners = owners
        self.label = label
        self.stage = stage
        self.microbatch = microbatch
        self.allow_unused_input = allow_unused_input
        self.params = (
            tuple(p for p in fn.parameters() if p.requires_grad) if isinstance(fn, nn.Module) else ()
        )
        self.static_inputs = tuple(_static_copy(a) for a in sample_args)
        self.delay_flags = owners.delay_flags()
        self._bundle: WgradBundle | None = None
        self._parts: dict[str, object] = {"backward": None, "wgrad": None}
        self._hooks: dict[str, tuple[WeightGradStore, ...]] = {"forward": (), "backward": (), "wgrad": ()}
        self._flagged: dict[str, set[int]] = {"backward": set(), "wgrad": set()}

    def _capture(self, backend: GraphBackend, phase: str, fn: Callable[[], object]) -> tuple[object, object]:
        with muted_hooks(self.owners.stores) as fired:
            try:
                graph, result = backend.capture(fn, label=f"{self.label} {phase}")
            except GraphCaptureError as err:
                raise GraphCaptureError(f"{self.label}: capturing the {phase} graph failed: {err}") from err
        self._hooks[phase] = tuple(fired)
        return graph, result

    def _watch_added_flags(self) -> list[nn.Parameter]:
        flagged = [p for p in self.owners.candidates() if hasattr(p, "grad_added_to_main_grad")]
        for p in flagged:
            p.grad_added_to_main_grad = False
        return flagged

    # -- the three captures ---------------------------------------------------------------------------------
    def capture_forward(self, backend: GraphBackend) -> None:
        graph, result = self._capture(backend, "forward", lambda: self.fn(*self.static_inputs))
        outputs, kind = _as_tuple(result, self.label)
        self._parts["forward"] = graph
        self._outputs = outputs
        self._output_kind = kind

    def capture_backward(self, backend: GraphBackend) -> None:
        diff = [o for o in self._outputs if o.requires_grad]
        self._grad_outputs = tuple(torch.zeros_like(o) if o.requires_grad else None for o in self._outputs)
        wrt = _backward_wrt(self.static_inputs, self.params)
        self._grads: list[torch.Tensor | None] = [None] * len(wrt)
        if not diff:
            return
        strays = _untracked_leaves(diff, wrt)
        if strays:
            raise GraphCaptureError(
                f"{self.label}: the outputs depend on {len(strays)} tensor(s) requiring grad that are neither "
                f"inputs nor parameters of the callable (shapes {strays[:4]}); the graphs would never train "
                "them. Graph the nn.Module that owns them."
            )
        flagged = self._watch_added_flags()

        def run() -> tuple[tuple[torch.Tensor | None, ...], WgradBundle]:
            with capture_wgrad(defer_requested=True) as bundle:
                grads = torch.autograd.grad(
                    diff, wrt, [g for g in self._grad_outputs if g is not None], allow_unused=True
                )
            return grads, bundle

        graph, (grads, bundle) = self._capture(backend, "backward", run)
        self._parts["backward"] = graph
        self._grads = list(grads)
        self._bundle = bundle
        self._flagged["backward"] = {id(p) for p in flagged if p.grad_added_to_main_grad}
        known = {id(s) for s in self.owners.stores}
        strangers = sorted({t.label for t in bundle.tasks if id(t.store) not in known})
        if strangers:
            bundle.discard()
            raise GraphCaptureError(
                f"{self.label}: deferred weight gradients of {strangers} come from layers that are not "
                "submodules of the captured callable, so their parameters and hooks cannot be tracked; "
                "graph the nn.Module that owns them"
            )
        if len(bundle) and not any(delay for _, delay in self.delay_flags):
            labels = sorted({t.label for t in bundle.tasks})
            bundle.discard()
            raise GraphCaptureError(
                f"{self.label}: {labels} deferred their weight gradient although no owner reported "
                "need_backward_dw() when the capture order was planned; keep delay_wgrad_compute fixed"
            )

    def capture_wgrad(self, backend: GraphBackend) -> None:
        tasks = self._bundle.tasks if self._bundle is not None else ()
        flagged = self._watch_added_flags()

        def run() -> None:
            for task in tasks:
                task.run(fire_hooks=False)

        graph, _ = self._capture(backend, "wgrad", run)
        self._parts["wgrad"] = graph
        self._hooks["wgrad"] = tuple(t.store for t in tasks) + self._hooks["wgrad"]
        self._flagged["wgrad"] = {id(p) for p in flagged if p.grad_added_to_main_grad}

    def abort(self) -> None:
        """Drop parked tasks of a failed capture on purpose (no 'lost gradient' warning at GC)."""
        if self._bundle is not None:
            self._bundle.discard()

    # -- assembling the callable --------------------------------------------------------------------------
    def _targets(
        self, phase: str, stores: Sequence[WeightGradStore], buffers: dict[int, torch.Tensor]
    ) -> tuple[GradTarget, ...]:
        targets = []
        for p in self.owners.params_of(stores):
            grad = buffers.get(id(p))
            targets.append(
                GradTarget(
                    p,
                    self.owners.name_of(p),
                    grad=grad,
                    main_grad=getattr(p, "main_grad", None) if grad is None else None,
                    sets_added_flag=id(p) in self._flagged[phase],
                )
            )
        return tuple(targets)

    def finish(self, buffers: dict[int, torch.Tensor]) -> GraphedCallable:
        """Check unused inputs and build the :class:`GraphedCallable`.

        Args:
            buffers: ``id(param) -> .grad`` buffer, for the parameters whose gradient a graph writes to ``.grad``.
        """
        written = {id(p) for p in self.owners.params_of(self._hooks["backward"] + self._hooks["wgrad"])}
        wrt = _backward_wrt(self.static_inputs, self.params)
        if self._parts["backward"] is not None and not self.allow_unused_input:
            for tensor, grad in zip(wrt, self._grads):
                if grad is None and id(tensor) not in written:
                    what = (
                        self.owners.name_of(tensor)
                        if isinstance(tensor, nn.Parameter)
                        else f"input {next(i for i, x in enumerate(self.static_inputs) if x is tensor)}"
                    )
                    raise GraphCaptureError(
                        f"{self.label}: {what} requires grad but receives none from the captured backward; "
                        "pass allow_unused_input=True if that is intended"
                    )
        grad_of = dict(zip(map(id, wrt), self._grads))
        returns = tuple(
            (g.detach() if (g := grad_of.get(id(t))) is not None else None)
            for t in (*self.static_inputs, *self.params)
        )
        captured = CapturedGraphs(
            forward=self._parts["forward"],
            backward=self._parts["backward"],
            wgrad=self._parts["wgrad"],
            static_inputs=self.static_inputs,
            static_outputs=tuple(o.detach() for o in self._outputs),
            output_requires_grad=tuple(o.requires_grad for o in self._outputs),
            output_kind=self._output_kind,
            static_grad_outputs=self._grad_outputs,
            grad_returns=returns,
            forward_hooks=self._hooks["forward"],
            backward_hooks=self._hooks["backward"],
            wgrad_hooks=self._hooks["wgrad"],
            backward_targets=self._targets("backward", self._hooks["backward"], buffers),
            wgrad_targets=self._targets("wgrad", self._hooks["wgrad"], buffers),
            dw_params=tuple(self.owners.params_of(self._hooks["wgrad"])),
            delay_flags=self.delay_flags,
        )
        return GraphedCallable(
            self.fn,
            captured,
            label=self.label,
            stage=self.stage,
            microbatch=self.microbatch,
            params=self.params,
        )
