"""Per-rank bodies of the extension example's consumer tests (module-level, so the spawn harness can pickle them).

``examples/custom_split_layer.py``'s ``SplitEmbedding`` inside ``splitgrad.parallel.DistributedDataParallel``
(its deferred, fused wgrad announced through the hooks and reduced) and inside the pipeline runtime (its W
run by a zero-bubble schedule). Each check compares with a float64 plain-torch reference and returns
``{check: None | traceback}``; the test process asserts.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.parallel import DistributedDataParallel
from splitgrad.pipeline import build_runtime
from tests.conformance.cases import custom_split_layer_module

VOCAB, DIM, SEQ, MB, N_MB = 11, 6, 5, 2, 4
F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _model(*, fused: bool) -> nn.Sequential:
    """Embedding -> Linear -> GELU -> Linear(vocab), every layer deferring its wgrad (seeded, float64)."""
    torch.manual_seed(0)
    kw = {"delay_wgrad_compute": True, "fuse_wgrad_accumulation": fused, "params_dtype": F64}
    return nn.Sequential(
        custom_split_layer_module().SplitEmbedding(VOCAB, DIM, **kw),
        splitgrad.Linear(DIM, DIM, **kw),
        nn.GELU(),
        splitgrad.Linear(DIM, VOCAB, **kw),
    )


def _plain_twin(model: nn.Sequential) -> nn.Sequential:
    """The same function in plain torch (nn.Embedding / nn.Linear), same float64 parameters."""
    twin = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, VOCAB)).to(
        F64
    )
    twin.load_state_dict(model.state_dict())
    return twin


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (N_MB * MB, SEQ)
    return torch.randint(0, VOCAB, shape, generator=gen), torch.randint(0, VOCAB, shape, generator=gen)


def check_ddp(rank: int, world: int) -> None:
    """Two ranks, different tokens: every main_grad is the float64 average of the per-rank gradients."""
    model = _model(fused=True)
    twin = _plain_twin(model)
    ddp = DistributedDataParallel(model, process_group=dist.group.WORLD, bucket_size=100)
    ddp.zero_grad()
    ids, tgt = _batch(seed=rank)
    _loss(ddp(ids), tgt).backward()
    splitgrad.backward_dw(model)  # the embedding's wgrad goes into main_grad here, announced by its hook
    ddp.finish_grad_sync()
    batches = [_batch(seed=r) for r in range(world)]
    local = {}
    for r, (i, t) in enumerate(batches):
        twin.zero_grad()
        _loss(twin(i), t).backward()
        if r == rank:
            local = {n: p.grad.clone() for n, p in twin.named_parameters()}
        for p in twin.parameters():
            p.sum_grad = p.grad.clone() if r == 0 else p.sum_grad + p.grad
    for n, p in twin.named_parameters():
        got = model.get_parameter(n).main_grad
        torch.testing.assert_close(got, p.sum_grad / world, **TOL, msg=f"DDP {n}")
    # Not trivially passing: the unreduced local gradient of the embedding differs from the average.
    if torch.allclose(local["0.weight"], model[0].weight.main_grad, **TOL):
        raise AssertionError("the embedding's local gradient equals the average: the check cannot fail")
    ddp.remove_hooks()


def check_pipeline(rank: int, world: int) -> None:
    """Two pipeline ranks, zb-h1: loss and every local gradient equal the float64 reference; W ran."""
    model = _model(fused=False)
    twin = _plain_twin(model)
    stages = [model[:2], model[2:]]
    rt = build_runtime(stages, "zb-h1", n_microbatches=N_MB, loss_fn=_loss, timeout=60)
    ids, tgt = _batch(seed=7)
    result = rt.step(ids, tgt)
    total = sum(_loss(twin(i), t) for i, t in zip(ids.split(MB), tgt.split(MB))) / N_MB
    total.backward()
    if result.w_tasks == 0:
        raise AssertionError("zb-h1 ran no W action: the embedding's deferred wgrad was not exercised")
    local = [
        n for n, _ in model.named_parameters() if any(p is model.get_parameter(n) for p in rt.parameters())
    ]
    if rank == 0 and "0.weight" not in local:
        raise AssertionError(f"rank 0 should hold the embedding, holds {local}")
    for n in local:
        torch.testing.assert_close(model.get_parameter(n).grad, twin.get_parameter(n).grad, **TOL, msg=n)
    splitgrad.ensure_no_pending_wgrad(model, what="the end of the pipeline step")


CHECKS = {f.__name__: f for f in (check_ddp, check_pipeline)}


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """Run the named checks in order; ``{name: None | traceback}``."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            CHECKS[name](rank, world)
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc()
    return out
