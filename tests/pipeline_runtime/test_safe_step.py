"""SafeStep: global gradient-norm clipping and a NaN/inf skip across pipeline, data- and expert-parallel ranks.

Why: a pipeline rank sees a few stages, so clipping by its own norm, or skipping on its own NaN, trains another
model than the single-process run (and lets ranks disagree about whether a step happened). Each layout's
clipped gradients are compared with ``torch.nn.utils.clip_grad_norm_`` on the float64 single-process model;
the post-validated step (speculate, then roll back) must be bitwise the synchronous one. One 4-rank spawn
(``safe_step_checks.safe_steps``): pp2 x dp2 with DDP (``main_grad``), pp2 (``.grad``), pp2 x ep2 (MoE).
"""

from __future__ import annotations

import math

import pytest
import torch

from splitgrad.pipeline.safe_step import SafeStep
from splitgrad.testing import spawn
from tests.pipeline_runtime import safe_step_checks

RTOL, ATOL = 1e-10, 1e-12
LAYOUTS = ["ddp", "pp", "ep"]


@pytest.fixture(scope="module")
def reports():
    return spawn(safe_step_checks.safe_steps, 4, timeout=400, pg_timeout=120)


def _bitwise(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", LAYOUTS)
def test_clipping_is_the_single_process_float64_clipping(reports, kind):
    for rank, report in enumerate(reports):
        r = report[kind]
        sync = r["runs"]["sync"]
        assert math.isclose(sync["report"].norm, r["ref_norm"], rel_tol=1e-12), (rank, sync["report"], r)
        assert 0 < sync["report"].clip_coef < 1 and not sync["report"].skipped
        for name, got, want in zip(r["names"], sync["grads"], r["ref_clipped"], strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        # Not trivially passing: clipping by this rank's own norm gives other gradients.
        assert any(
            not torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(r["local_clip"], r["ref_clipped"])
        ), rank


@pytest.mark.distributed
@pytest.mark.parametrize("kind", LAYOUTS)
def test_post_validation_is_bitwise_the_synchronous_step(reports, kind):
    for rank, report in enumerate(reports):
        runs = report[kind]["runs"]
        # Clipping needed: every rank stepped speculatively (its own norm is below max_norm), rolled back
        # and redid the step clipped.
        assert runs["post"]["report"].rolled_back, rank
        assert not runs["sync"]["report"].rolled_back
        # Not needed: the speculative step stands.
        assert not runs["post-loose"]["report"].rolled_back and runs["post-loose"]["report"].clip_coef == 1.0
        for a, b in [("sync", "post"), ("sync-loose", "post-loose")]:
            assert runs[a]["report"].clip_coef == runs[b]["report"].clip_coef
            for part in ("params", "grads"):
                _bitwise(runs[a][part], runs[b][part])
            assert runs[a]["state"].keys() == runs[b]["state"].keys()
            for i, state in runs[a]["state"].items():
                _bitwise(list(state.values()), list(runs[b]["state"][i].values()))
        # The loose run did step: parameters moved.
        assert any(
            not torch.equal(a, b)
            for a, b in zip(runs["sync-loose"]["params"], report[kind]["saved"]["params"])
        )


@pytest.mark.distributed
@pytest.mark.parametrize("kind", LAYOUTS)
def test_an_infinite_gradient_on_one_rank_skips_the_step_everywhere(reports, kind):
    for rank, report in enumerate(reports):
        saved = report[kind]["saved"]
        for label in ("sync-inf", "post-inf"):
            run = report[kind]["runs"][label]
            if kind == "pp" and rank >= 2:  # "pp" runs two jobs (group=pp_group): the other one steps
                assert not run["report"].skipped and math.isfinite(run["report"].norm)
                continue
            assert run["report"].skipped and not math.isfinite(run["report"].norm), (rank, label)
            _bitwise(saved["params"], run["params"])
            for i, state in saved["state"].items():
                _bitwise(list(state.values()), list(run["state"][i].values()))
            assert all(float(s["step"]) == 1.0 for s in run["state"].values())  # AdamW's count not advanced


def test_safe_step_rejects_bad_arguments():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="max_norm must be positive"):
        SafeStep(opt, max_norm=0.0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        SafeStep(opt, timeout=-1)
