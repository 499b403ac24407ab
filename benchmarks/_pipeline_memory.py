"""Memory of the pipeline variants: a resident-set sampler, and what one microbatch keeps alive until its W.

Run under ``MALLOC_MMAP_THRESHOLD_=65536`` (``bench_pipeline.py`` sets it for its memory spawn): every tensor
above 64 KiB is then its own mapping, returned to the OS when freed, so the resident set follows live tensors.
"""

from __future__ import annotations

import os
import threading

import torch

import splitgrad
from _pipeline_variants import BenchConfig, cut


class RssSampler:
    """Background thread sampling this process's resident set size every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self._page

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def reset(self) -> int:
        """Start a new peak window; returns the current RSS (the baseline)."""
        self.peak = now = self.rss()
        return now

    def close(self) -> None:
        self._stop.set()


def b_to_w_memory(cfg: BenchConfig) -> dict[str, float]:
    """MiB held after F and after the input-gradient backward of one microbatch through one 2-block stage.

    ``torch I``: PyTorch's own I step (``stage_backward_input``, a private function, imported here only to
    measure it): the autograd graph is retained for W plus the gradients at the weight branch points.
    ``splitgrad B``: the adapter's and runtime's B: plain backward inside ``capture_wgrad``.
    """
    sampler = RssSampler(interval=3600.0)  # only explicit reads
    x0, dy = torch.randn(cfg.tokens, cfg.hidden), torch.randn(cfg.tokens, cfg.hidden)
    out: dict[str, float] = {}
    for name in ("torch I", "splitgrad B") * 2:  # the second pass is the one kept (allocator warm)
        # In a function so that everything of one pass is freed before the next pass's baseline.
        after_f, after_b = _one_microbatch(cfg, name, sampler, x0, dy)
        out[f"{name} after F"], out[f"{name} after B"] = after_f / 2**20, after_b / 2**20
    sampler.close()
    return out


def _one_microbatch(
    cfg: BenchConfig, name: str, sampler: RssSampler, x0: torch.Tensor, dy: torch.Tensor
) -> tuple[int, int]:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    stage = cut(cfg, name.startswith("splitgrad"), cfg.n_blocks // 2)[0]
    base = sampler.rss()
    x = x0.detach().requires_grad_()
    y = stage(x)
    after_f = sampler.rss() - base
    if name == "torch I":
        _, groups = stage_backward_input([y], [dy], [x], stage.parameters())
        after_b = sampler.rss() - base
        stage_backward_weight(stage.parameters(), groups)
    else:
        with splitgrad.capture_wgrad() as bundle:
            torch.autograd.backward(y, dy)
        after_b = sampler.rss() - base
        bundle.run()
    return after_f, after_b
