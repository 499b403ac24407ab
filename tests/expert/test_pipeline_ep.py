"""Expert-parallel MoE stages in the pipeline runtime: pp = 2 x ep = 2 on 4 gloo ranks, exact.

Why: batch-level overlap must be available where it pays, inside a pipeline (Megatron-Core's combined 1F1B,
DualPipe). Each pipeline rank's MoE layers exchange tokens with the same stage of the other replica, while the
runtime sends activations along the pipeline; the overlapped ``F+B`` pairs (``1f1b`` through
``fuse_overlap_pairs``, ``dualpipev``) run one microbatch's forward while another's backward runs and the
experts' deferred weight gradients inside the backward dispatch. Every loss and gradient is compared in
float64 with the single-process ``MoEGPT`` on the global batch, and the overlapped schedules bitwise with the
same computation in order. Megatron-Core runs this overlap across pipeline ranks only inside its interleaved
(virtual-pipeline) combined 1F1B; ``interleaved-1f1b`` with ``overlap=True`` is that order, run here with two
stages per rank, with deferred (delayed) and immediate weight gradients.
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
# (label, schedule, overlapped stages, delayed wgrad): pp = 2 with 2 virtual stages per rank.
INTERLEAVED = [
    ("interleaved", "interleaved-1f1b", False, True),
    ("interleaved+overlap", "interleaved-1f1b+overlap", True, True),
    ("interleaved immediate", "interleaved-1f1b", False, False),
    ("interleaved+overlap immediate", "interleaved-1f1b+overlap", True, False),
]


@pytest.fixture(scope="module")
def reports():
    """One 4-rank spawn for every run of this file."""
    return spawn(pipeline_checks.pipeline_ep, 4, RUNS + INTERLEAVED, timeout=400.0, pg_timeout=150.0)


def test_pipeline_with_expert_parallel_stages_is_exact(reports):
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


def test_interleaved_combined_1f1b_with_expert_parallel_stages_is_exact(reports):
    """Megatron's combined 1F1B under virtual pipelining on pp = 2 x ep = 2: every gradient against the single
    process (checked on the ranks), the pairs ran as pairs, bitwise equal to the same order without pairs."""
    for rank, report in enumerate(reports):
        for label, _, overlapped, delayed in INTERLEAVED:
            assert report[label]["checked"] > 0, (rank, label)
            # pp rank 0 pairs 3 of its 8 (stage, microbatch) units, pp rank 1 pairs 5 (warm-ups 5 and 3).
            assert report[label]["pairs"] == ((3 if rank % 2 == 0 else 5) if overlapped else 0), (rank, label)
            if overlapped and delayed:
                assert report[label]["in_dispatch"] > 0, (rank, label)
        for plain, fused in [("interleaved", "interleaved+overlap"),
                             ("interleaved immediate", "interleaved+overlap immediate")]:  # fmt: skip
            a, b = report[plain]["grads"], report[fused]["grads"]
            assert a.keys() == b.keys()
            for name in a:
                torch.testing.assert_close(
                    b[name], a[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
                )
