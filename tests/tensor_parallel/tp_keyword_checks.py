"""Checks of TE keywords that need a real TP group (run inside the spawned gloo ranks of test_tp_linear).

``get_rng_state_tracker``: without it every TP rank draws its shard from the same default seed (identical
shards); forked, the shards differ per rank, are reproducible, and leave the default generator untouched.
``return_layernorm_output_gathered``: the returned norm output is the full sequence, its gradient summed over
the ranks and reduce-scattered back to the shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import splitgrad
from tests.tensor_parallel.rng_tracker import megatron_tracker

F64 = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def check_rng_tracker_init(rank: int, world: int) -> None:
    """Forked init differs per TP rank, is reproducible, matches a one-process fork, keeps the default RNG."""
    kinds = {
        "Linear": lambda **kw: splitgrad.Linear(12, 18, parallel_mode="column", **kw).weight,
        "LayerNormLinear": lambda **kw: (
            splitgrad.LayerNormLinear(12, 18, parallel_mode="column", **kw).weight
        ),
        "LayerNormMLP": lambda **kw: splitgrad.LayerNormMLP(12, 18, **kw).fc1_weight,
    }
    for kind, make in kinds.items():
        torch.manual_seed(0)
        plain = make(tp_group=dist.group.WORLD).detach()
        if not all(torch.equal(p, plain) for p in _gather(plain)):
            raise AssertionError(f"{kind}: without a tracker the shards should repeat the same default draw")
        torch.manual_seed(0)
        before = torch.get_rng_state()
        tracker = megatron_tracker(rank)
        forked = make(tp_group=dist.group.WORLD, get_rng_state_tracker=lambda t=tracker: t).detach()
        if not torch.equal(torch.get_rng_state(), before):
            raise AssertionError(f"{kind}: the forked init advanced the default generator")
        shards = _gather(forked)
        if any(torch.equal(shards[0], s) for s in shards[1:]):
            raise AssertionError(f"{kind}: forked init gave two TP ranks the same shard")
        again_tracker = megatron_tracker(rank)
        again = make(tp_group=dist.group.WORLD, get_rng_state_tracker=lambda t=again_tracker: t).detach()
        torch.testing.assert_close(again, forked, rtol=0, atol=0)  # reproducible
        # The same draw as one process forking rank `rank`'s state for a layer of the local shape.
        one = megatron_tracker(rank)
        with one.fork():
            if kind == "LayerNormMLP":
                expected = splitgrad.LayerNormMLP(12, 18 // world).fc1_weight
            else:
                expected = splitgrad.Linear(12, 18 // world).weight
        torch.testing.assert_close(forked, expected.detach(), rtol=0, atol=0)

    # rng_tracker_name picks the named state (Linear only, as TE).
    def linear(name: str | None) -> torch.Tensor:
        tracker = megatron_tracker(rank)
        return splitgrad.Linear(
            12, 18, parallel_mode="column", tp_group=dist.group.WORLD,
            get_rng_state_tracker=lambda: tracker, rng_tracker_name=name,
        ).weight.detach()  # fmt: skip

    named = linear("expert-parallel-rng")
    one = megatron_tracker(rank)
    with one.fork("expert-parallel-rng"):
        expected = splitgrad.Linear(12, 18 // world).weight.detach()
    torch.testing.assert_close(named, expected, rtol=0, atol=0)
    if torch.equal(named, linear(None)):  # negative: an ignored name would draw the default fork's values
        raise AssertionError("rng_tracker_name was ignored: the named fork drew the default fork's values")


def check_layernorm_output_gathered(rank: int, world: int) -> None:
    """SP ``return_layernorm_output_gathered``: full-sequence norm output; its gradient reaches every shard."""
    s, b, h = 6, 2, 12
    gen = torch.Generator().manual_seed(5)
    x_full = torch.randn(s, b, h, dtype=F64, generator=gen)
    g_ln = torch.randn(s, b, h, dtype=F64, generator=gen)  # the loss's gradient on the gathered ln_out
    torch.manual_seed(1)
    ref = splitgrad.LayerNormLinear(h, 18, params_dtype=F64, return_layernorm_output=True)
    xr = x_full.clone().requires_grad_(True)
    _, ln_ref = ref(xr)
    (ln_ref * g_ln).sum().backward()
    rows = slice(rank * s // world, (rank + 1) * s // world)
    for gathered in (True, False):
        torch.manual_seed(1)
        tp = splitgrad.LayerNormLinear(
            h, 18, params_dtype=F64, parallel_mode="column", tp_group=dist.group.WORLD, sequence_parallel=True,
            return_layernorm_output=True, return_layernorm_output_gathered=gathered,
        )  # fmt: skip
        x = x_full[rows].clone().requires_grad_(True)
        _, ln = tp(x)
        if not gathered:
            if ln.shape != (s // world, b, h):
                raise AssertionError(f"not gathered: expected the local shard, got {tuple(ln.shape)}")
            continue
        if ln.shape != (s, b, h):
            raise AssertionError(f"gathered ln_out has shape {tuple(ln.shape)}, expected {(s, b, h)}")
        torch.testing.assert_close(ln, ln_ref.detach(), **TOL)
        # Every rank's loss uses the whole gathered output: the summed gradient is world x the reference's.
        (ln * g_ln).sum().backward()
        torch.testing.assert_close(x.grad, world * xr.grad[rows], **TOL)
        if torch.allclose(x.grad, xr.grad[rows], **TOL):
            raise AssertionError("the gathered output's gradient was not summed over the ranks")


ALL = ["check_rng_tracker_init", "check_layernorm_output_gathered"]
