"""The README's quick start, runnable: deferred wgrad, per-microbatch bundles, the optimizer guard.

Run: ``.venv/bin/python examples/quickstart.py``
"""

from __future__ import annotations

import torch

import splitgrad


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        splitgrad.Linear(64, 256, delay_wgrad_compute=True),
        torch.nn.GELU(),
        splitgrad.Linear(256, 64, delay_wgrad_compute=True),
    )
    reference = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    splitgrad.guard_optimizer(opt, model)

    microbatches = [torch.randn(32, 64) for _ in range(3)]
    bundles = []
    for x in microbatches:
        with splitgrad.capture_wgrad() as bundle:  # B: input gradients now, W parked per microbatch
            model(x).square().mean().backward()
        bundles.append(bundle)
        reference(x).square().mean().backward()
    print(
        f"after 3 backwards: {len(bundles)} bundles of {len(bundles[0])} wgrad tasks, weight.grad is",
        model[0].weight.grad,
    )
    try:
        opt.step()
    except RuntimeError as err:
        print("optimizer.step() refused:", str(err).split(".")[0])
    for bundle in reversed(bundles):  # W steps in any order
        bundle.run()
    same = all(
        torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters())
    )
    print("gradients equal plain autograd:", same)
    opt.step()


if __name__ == "__main__":
    main()
