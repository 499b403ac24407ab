"""Expert-parallel MoE stages in the pipeline runtime: pp = 2 x ep = 2 on 4 gloo ranks, exact.

Why: batch-level overlap must be available where it pays, inside a pipeline (Megatron-Core's combined 1F1B,
DualPipe). Each pipeline rank's MoE layers exchange tokens with the same stage of the other replica, while the
runtime sends activations along the pipeline; the overlapped ``F+B`` pairs (``1f1b`` through
``fuse_overlap_pairs``, ``dualpipev``) run one microbatch's forward while another's backward runs and the
experts' deferred weight gradients inside the backward dispatch. Every loss and gradient is compared in
float64 with the single-process ``MoEGPT`` on the global batch, and the overlapped schedules bitwise with the
same computation in order.
"""

from __future__ import annotations

import pytest
import torch

from splitgrad.testing import spawn
from tests.expert import pipeline_checks

pytestmark = pytest.mark.distributed

RUNS = [
    ("1f1b", "1f1b", False),
    ("1f1b+overlap", "1f1b+overlap", True),
    ("dualpipev-plain", "dualpipev-plain", False),
    ("dualpipev", "dualpipev", True),
]


def test_pipeline_with_expert_parallel_stages_is_exact():
    reports = spawn(pipeline_checks.pipeline_ep, 4, RUNS, timeout=300.0, pg_timeout=150.0)
    for rank, report in enumerate(reports):
        assert all(report[label]["checked"] > 0 for label, _, _ in RUNS), rank
        assert all(report[label]["in_dispatch"] > 0 for label, _, overlapped in RUNS if overlapped)
        # Overlapped pairs are the same arithmetic as the same schedule in order: bitwise.
        for plain, fused in [("1f1b", "1f1b+overlap"), ("dualpipev-plain", "dualpipev")]:
            a, b = report[plain]["grads"], report[fused]["grads"]
            assert a.keys() == b.keys()
            for name in a:
                torch.testing.assert_close(
                    b[name], a[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
                )
