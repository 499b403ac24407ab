"""The split contract through the torch-adapter stage: PyTorch's zero-bubble schedule drives splitgrad's W.

Why: the adapter is a split-capable consumer the registry cannot call directly (PyTorch's schedule decides
when I and W run), so its clauses are checked here on the same terms: float64 reference, bitwise equal to the
same layers in immediate mode, wgrad hooks once per W after the write, frozen parameters, the flags and
``get_backward_dw_params``, and nothing owed after a step. Bundle order is the schedule's (not ours) here.

Two stages on one rank in an in-process one-rank gloo group (FileStore): no processes are spawned. The 2-rank
schedules are covered by ``tests/torch_adapter``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

import splitgrad
from splitgrad.pipeline.torch_adapter import splitgrad_pipeline_stage
from tests.helpers import grads, one_rank_group

from .driver import EXACT, F64, assert_grads

N_MB = 4
D = torch.float64


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo process group in this process (torch's pipelining needs one even for local stages)."""
    yield from one_rank_group(tmp_path_factory)


def _stages(delay: bool, frozen: tuple[str, ...] = ()) -> nn.Sequential:
    """stage 0: Linear + GELU, stage 1: LayerNormLinear; parameters drawn at random (seeded)."""
    kw = {"delay_wgrad_compute": delay, "params_dtype": D}
    model = nn.Sequential(
        nn.Sequential(splitgrad.Linear(8, 12, **kw), nn.GELU()),
        nn.Sequential(splitgrad.LayerNormLinear(12, 8, **kw)),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=D) * 0.5)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)  # 3-D activations: the shape PyTorch's own I/W split cannot detach
    return torch.randn(2 * N_MB, 3, 8, generator=gen, dtype=D), torch.randn(
        2 * N_MB, 3, 8, generator=gen, dtype=D
    )


def _pipelined(model: nn.Sequential, group) -> list:
    stages = [splitgrad_pipeline_stage(model[s], s, 2, "cpu", group=group) for s in range(2)]
    schedule = ScheduleInterleavedZeroBubble(stages, N_MB, loss_fn=F.mse_loss)
    x, y = _batch()
    schedule.step(x, target=y)
    return stages


def _in_process(model: nn.Sequential) -> None:
    """What the schedule computes, in one process: each microbatch's loss backward, gradients / N_MB."""
    x, y = _batch()
    for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB), strict=True):
        F.mse_loss(model(xm), ym).backward()
    splitgrad.backward_dw(model)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(N_MB)


def _plain_reference(model: nn.Sequential) -> dict[str, torch.Tensor | None]:
    """Plain float64 autograd (textbook formulas) on copies of ``model``'s parameters."""
    p = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in model.named_parameters()}

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x @ p["0.0.weight"].t() + p["0.0.bias"]
        h = 0.5 * h * (1 + torch.erf(h / 2**0.5))
        mean, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
        ln = (h - mean) / torch.sqrt(var + 1e-5) * p["1.0.layer_norm_weight"] + p["1.0.layer_norm_bias"]
        return ln @ p["1.0.weight"].t() + p["1.0.bias"]

    x, y = _batch()
    losses = [((forward(xm) - ym) ** 2).mean() for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB), strict=True)]
    (sum(losses) / N_MB).backward()
    return {n: t.grad for n, t in p.items()}


def test_matches_float64_reference_and_immediate_bitwise(group):
    model = _stages(delay=True)
    stages = _pipelined(model, group)
    assert all(not st.pending_microbatches for st in stages)
    splitgrad.ensure_no_pending_wgrad(model, what="the end of the step")
    got = grads(model)
    assert_grads(got, _plain_reference(model), F64, "adapter stage vs float64 autograd")
    immediate = _stages(delay=False)
    _in_process(immediate)
    assert_grads(got, grads(immediate), EXACT, "adapter stage vs the same layers in immediate mode")
    # Not trivially passing: one microbatch's W left out is rejected by the same comparison.
    wrong = _stages(delay=False)
    x, y = _batch()
    F.mse_loss(wrong(x.chunk(N_MB)[0]), y.chunk(N_MB)[0]).backward()
    with pytest.raises(AssertionError, match="float64 autograd"):
        assert_grads(grads(wrong), _plain_reference(model), F64, "one microbatch vs float64 autograd")


def test_hooks_fire_once_per_microbatch_after_the_write(group):
    model = _stages(delay=True)
    layers = [m for _, m in splitgrad.split_modules(model)]
    seen: dict[int, list[torch.Tensor | None]] = {i: [] for i in range(len(layers))}
    for i, layer in enumerate(layers):
        layer.register_wgrad_accumulation_and_reduce_hooks(
            lambda i=i, w=layer.weight: seen[i].append(None if w.grad is None else w.grad.clone())
        )
    _pipelined(model, group)
    for i, layer in enumerate(layers):
        assert len(seen[i]) == N_MB, f"{type(layer).__name__}: hook fired {len(seen[i])}x for {N_MB} W's"
        assert all(g is not None for g in seen[i]), "a hook fired before its gradient was written"
        assert len({g.sum().item() for g in seen[i]}) == N_MB, "a W wrote nothing before its hook"
        # The schedule divides by N_MB after the last W (a power of two: exact).
        torch.testing.assert_close(seen[i][-1] / N_MB, layer.weight.grad, **EXACT)


def test_frozen_parameters_and_flags(group):
    frozen = ("1.0.bias", "0.0.weight")
    model = _stages(delay=True, frozen=frozen)
    for _, layer in splitgrad.split_modules(model):
        listed = {id(p) for p in layer.get_backward_dw_params()}
        for name, p in layer.named_parameters():
            deferred = name in (
                "weight",
                "bias",
            )  # the layers' matrices and biases; norms go through autograd
            assert (id(p) in listed) == (p.requires_grad and deferred), name
            if p.requires_grad:
                flag = getattr(p, "skip_backward_post_hook", False)
                assert flag == deferred, f"{type(layer).__name__}.{name}.skip_backward_post_hook={flag}"
    _pipelined(model, group)
    got = grads(model)
    assert all(got[n] is None for n in frozen), {n: got[n] for n in frozen}
    assert_grads(got, _plain_reference(model), F64, "adapter stage, frozen parameters")
