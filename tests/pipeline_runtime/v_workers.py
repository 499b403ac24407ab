"""Per-rank body of the V-Half / V-Min runtime test (module-level: ``spawn`` pickles it by name).

The model is ``2p`` identical stages, each a splitgrad ``Linear(D, D)`` with deferred wgrad and a ``Tanh``, so
that one microbatch's activations weigh the same on every stage: its forward saves the ``Linear``'s input and
the ``Tanh``'s output (two ``(MB, D)`` tensors; parameters are not activations), and its ``B`` keeps the input
and the output gradient for ``W`` (again two). The loss multiplies by a plain-number target, which saves no
tensor. So the runtime's measured peak bytes must be exactly that unit times the simulator's
``peak_activations`` of the rank (``w_memory = 1``).
"""

from __future__ import annotations

import torch
from torch import nn

import splitgrad
from splitgrad.pipeline import build_schedule, simulate
from splitgrad.pipeline.runtime import build_runtime

D, MB = 8, 3
RTOL, ATOL = 1e-12, 1e-14


def _stages(n: int, *, delay: bool) -> list[nn.Module]:
    torch.manual_seed(3)
    return [
        nn.Sequential(
            splitgrad.Linear(D, D, delay_wgrad_compute=delay, params_dtype=torch.float64), nn.Tanh()
        )
        for _ in range(n)
    ]


def _loss(y: torch.Tensor, target: float) -> torch.Tensor:
    return (y * target).sum()


def v_schedule_worker(rank: int, world: int, names: list[str], m: int) -> dict:
    """Per schedule: the float64 check of every local gradient and the loss, the measured activation bytes
    (per stage and microbatch, forward and kept for W), the measured peak and the simulated peak of the rank."""
    n = 2 * world
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(MB, D, generator=gen, dtype=torch.float64) for _ in range(m)]
    targets = [0.5 + 0.25 * j for j in range(m)]
    reference = nn.Sequential(*_stages(n, delay=False))
    total = sum(_loss(reference(x), t) for x, t in zip(inputs, targets)) / m
    total.backward()
    ref = {name: p.grad for name, p in reference.named_parameters()}
    out: dict = {}
    for name in names:
        stages = _stages(n, delay=True)
        model = nn.Sequential(*stages)
        schedule = build_schedule(name, n, m)
        rt = build_runtime(stages, schedule, loss_fn=_loss, timeout=60, track_memory=True)
        result = rt.step(inputs, targets)
        names_of = {id(p): pname for pname, p in model.named_parameters()}
        bad, checked = [], 0
        for p in rt.parameters():
            pname = names_of[id(p)]
            checked += 1
            if not torch.allclose(p.grad, ref[pname], rtol=RTOL, atol=ATOL):
                bad.append(f"{pname}: max err {(p.grad - ref[pname]).abs().max().item():.3g}")
        # Not trivially passing: the same gradients against another stage's reference are refused.
        mine = [names_of[id(p)] for p in rt.parameters() if names_of[id(p)].endswith("weight")]
        other = f"{(int(mine[0].split('.')[0]) + 1) % n}.0.weight"
        wrong_accepted = torch.allclose(model.get_parameter(mine[0]).grad, ref[other], rtol=RTOL, atol=ATOL)
        meter = rt.executor.meter
        out[name] = {
            "bad": bad,
            "checked": checked,
            "wrong_accepted": wrong_accepted,
            "loss": result.loss.item(),
            "ref_loss": total.item(),
            "w_tasks": result.w_tasks,
            "forward_bytes": sorted({b for v in meter.forward_bytes.values() for b in v}),
            "held_bytes": sorted({b for v in meter.held_bytes.values() for b in v}),
            "samples": sum(len(v) for v in meter.forward_bytes.values()),
            "peak_bytes": result.peak_activation_bytes,
            "simulated_peak": simulate(schedule).peak_activations[rank],
        }
        rt.close()
    return out
