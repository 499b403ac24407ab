"""Data parallelism driven by gradient readiness (autograd hooks and splitgrad's wgrad hooks).

* :mod:`.ddp` -- :class:`DistributedDataParallel`, the wrapper (construction, forward, hooks, closing);
* :mod:`.grad_sync` -- the gradient sync it owns: contributions -> bucket launches -> ``finish_grad_sync``;
* :mod:`.lazy_zero` -- which ``main_grad`` slices are only marked zero;
* :mod:`.buckets` -- the contiguous per-dtype buffers and the buckets cut from them;
* :mod:`.readiness` -- how many contributions each parameter will get this step;
* :mod:`.hooks` -- the hooks, holding the sync weakly;
* :mod:`.config` -- :class:`DDPConfig`.
"""

from __future__ import annotations

from .config import DDPConfig
from .ddp import DistributedDataParallel

__all__ = ["DDPConfig", "DistributedDataParallel"]
