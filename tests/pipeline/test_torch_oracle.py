"""PyTorch's own schedule checks as an oracle for splitgrad's schedules, and back.

Why: splitgrad's validator and simulator were written here; PyTorch's ``_validate_schedule`` (completeness,
per-stage counts, the stage-to-rank mapping), ``_add_send_recv`` (lowering to sends and receives, which
raises on a schedule that cannot be lowered) and ``_simulate_comms_compute`` (raises when a schedule stops
making progress) were not. Every splitgrad family is converted to PyTorch's ``_Action`` lists over the grid
of PyTorch's ``test_schedule.py`` and must pass all three; PyTorch's own schedule classes over the same grid
must pass splitgrad's validator.

Each family is mapped onto a grid case ``(local stages, microbatches, group size)`` as its shape allows:
one-stage-per-rank families on ``group size`` stages (cases differing only in local stages are run once),
``interleaved-1f1b`` with ``stages_per_rank = local stages``, the V families only where ``local stages ==
2`` (PyTorch's test expects ``ValueError`` elsewhere). A family that refuses a case must refuse it with
``ValueError`` exactly where PyTorch's counterpart does (``dualpipev``: fewer microbatches than stages;
``interleaved-1f1b``: microbatches not a multiple of the ranks, which PyTorch's ``Interleaved1F1B`` test skips).

One budget limit, for CI time (2-core machine): the grid's largest case, ``(4, 128, 64)`` (64 ranks, 128
microbatches), costs more than all others together (PyTorch's simulator alone takes ~40 s on the
``interleaved-1f1b`` schedule, its ``ScheduleLoopedBFS`` constructor ~10 s). It runs once, for
``interleaved-1f1b`` (the family PyTorch's own test runs there), through validation and lowering only.
"""

from __future__ import annotations

import copy

import pytest
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import (
    _add_send_recv,
    _simulate_comms_compute,
    _validate_schedule,
)

from splitgrad.pipeline import build_schedule, validate
from splitgrad.pipeline.torch_actions import from_torch_actions, to_torch_actions
from tests.pipeline.torch_grid import GRID, torch_schedule

LARGEST = (4, 128, 64)
ONE_STAGE = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto")
V_FAMILIES = ("zbv", "zbv-auto", "dualpipev")
FAMILIES = (*ONE_STAGE, "interleaved-1f1b", *V_FAMILIES)


def family_cases(family: str) -> list[tuple[int, int, dict, bool]]:
    """``(n_stages, n_microbatches, options, torch_refuses)`` for ``family`` over the grid (see docstring)."""
    cases = []
    for n_local, m, group in GRID:
        if (n_local, m, group) == LARGEST:
            continue
        if family in ONE_STAGE:
            cases.append((group, m, {}, False))
        elif family == "interleaved-1f1b":
            cases.append((n_local * group, m, {"stages_per_rank": n_local}, m % group != 0))
        elif n_local == 2:
            cases.append((2 * group, m, {}, family == "dualpipev" and m < 2 * group))
    unique = []
    for case in cases:
        if case not in unique:
            unique.append(case)
    return unique


def check_with_torch(schedule, n_ranks: int, *, simulate: bool = True) -> None:
    """PyTorch's validation, lowering and simulation of ``schedule``; raises on any problem."""
    n_stages, m = schedule.n_stages, schedule.n_microbatches
    order = to_torch_actions(schedule)
    assert from_torch_actions(order, n_microbatches=m, name=schedule.name) == schedule
    stage_to_rank = _validate_schedule(copy.deepcopy(order), n_ranks, n_stages, m)
    assert stage_to_rank == dict(enumerate(schedule.stage_to_rank))
    lowered = _add_send_recv(order, stage_to_rank=schedule.rank_of, num_stages=n_stages)
    if simulate:
        _simulate_comms_compute(lowered, stage_to_rank=schedule.rank_of, num_stages=n_stages)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_passes_pytorchs_schedule_checks(family):
    checked = refused = 0
    for n_stages, m, options, torch_refuses in family_cases(family):
        if family == "dualpipev":
            options = {**options, "overlap": False}  # pairs: see test_overlapped_pairs_*
        try:
            schedule = build_schedule(family, n_stages, m, **options)
        except ValueError:
            assert torch_refuses, f"{family} refused {n_stages=} {m=} {options}"
            refused += 1
            continue
        assert not torch_refuses, f"{family} built {n_stages=} {m=}, which PyTorch's counterpart refuses"
        check_with_torch(schedule, schedule.n_ranks)
        checked += 1
    assert checked >= 4, f"{family}: only {checked} grid cases checked"
    if family in ("dualpipev", "interleaved-1f1b"):
        assert refused, f"{family}: no grid case refused"


def test_interleaved_on_the_largest_grid_case():
    n_local, m, group = LARGEST
    schedule = build_schedule("interleaved-1f1b", n_local * group, m, stages_per_rank=n_local)
    check_with_torch(schedule, group, simulate=False)


@pytest.mark.parametrize(
    "cls",
    [
        S.ScheduleInterleaved1F1B,
        S.ScheduleLoopedBFS,
        S.ScheduleInterleavedZeroBubble,
        S.ScheduleZBVZeroBubble,
        S.ScheduleDualPipeV,
    ],
    ids=lambda c: c.__name__,
)
def test_pytorch_schedules_pass_splitgrads_validator(cls):
    checked = 0
    for n_local, m, group in GRID:
        if (n_local, m, group) == LARGEST:
            continue
        try:
            theirs = torch_schedule(cls, n_local, m, group)
        except ValueError:
            continue  # PyTorch refuses the case (V classes: n_local != 2; DualPipeV: m < stages; ...)
        schedule = from_torch_actions(theirs.pipeline_order, n_microbatches=m, name=cls.__name__)
        validate(schedule)
        checked += 1
    assert checked >= 4


def test_a_broken_schedule_is_rejected_by_both():
    """Negative check: a W moved before its input gradient fails PyTorch's and splitgrad's validation."""
    schedule = build_schedule("zb-h1", 2, 4)
    acts = list(schedule.rank_actions[1])
    i = next(i for i, a in enumerate(acts) if a.kind.value == "B")
    w = next(j for j, a in enumerate(acts) if a.kind.value == "W" and a.microbatch == acts[i].microbatch)
    acts.insert(i, acts.pop(w))
    broken = type(schedule)(schedule.name, 4, schedule.stage_to_rank, (schedule.rank_actions[0], acts))
    with pytest.raises(AssertionError, match="Running Backward Weight for stage 1, microbatch"):
        _validate_schedule(to_torch_actions(broken), 2, 2, 4)
    with pytest.raises(ValueError, match="cannot run"):
        validate(broken)


def test_overlapped_pairs_are_lowered_by_pytorch_but_not_simulated():
    """PyTorch's simulator does not look inside ``OVERLAP_F_B`` (it reads the pair's stage, -1), for its own
    DualPipeV and for splitgrad's dualpipev alike; its validator and lowering do. splitgrad's validator checks
    the pairs (both parts' dependencies), so that is where overlapped schedules are checked."""
    ours = build_schedule("dualpipev", 8, 10)
    theirs = torch_schedule(S.ScheduleDualPipeV, 2, 10, 4)
    for order, s2r in ((to_torch_actions(ours), ours.rank_of), (theirs.pipeline_order, ours.rank_of)):
        assert any(a is not None and a.sub_actions for acts in order.values() for a in acts)
        _validate_schedule(copy.deepcopy(order), 4, 8, 10)
        lowered = _add_send_recv(copy.deepcopy(order), stage_to_rank=s2r, num_stages=8)
        with pytest.raises(ValueError, match="stage -1 out of range"):
            _simulate_comms_compute(lowered, stage_to_rank=s2r, num_stages=8)
    validate(ours)
    # Negative check: swapping the backward parts of the last rank's first and last pair of the same stage
    # makes the first pair run a backward whose forward has not run yet.
    rank = list(ours.rank_actions[3])
    pairs = [i for i, a in enumerate(rank) if a.kind.value == "FB"]
    first = pairs[0]
    last = max(i for i in pairs if rank[i].backward.stage == rank[first].backward.stage)
    rank[first], rank[last] = (
        rank[first]._replace(backward=rank[last].backward),
        rank[last]._replace(backward=rank[first].backward),
    )
    bad = type(ours)(ours.name, 10, ours.stage_to_rank, (*ours.rank_actions[:3], rank))
    with pytest.raises(ValueError, match="cannot run"):
        validate(bad)
