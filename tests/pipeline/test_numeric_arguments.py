"""``build_schedule`` / ``simulate`` take numpy scalars and integral floats, and reject the rest clearly.

Why: counts and costs often come out of numpy or arithmetic (``np.int64(8)``, ``memory_limit=8.0``,
``f=np.float32(1.0)``); they used to die with a ``TypeError`` from deep inside (``'numpy.float32' object is
not iterable``). Integral values of any numeric type must give exactly the schedule plain ints give; bools,
fractions, NaN/inf, negatives and strings must raise a ``ValueError`` naming the argument and the value.
"""

from __future__ import annotations

import numpy as np
import pytest

from splitgrad.pipeline import build_runtime, build_schedule, simulate
from splitgrad.pipeline.schedules import zb_auto


@pytest.mark.parametrize(
    ("name", "args", "options", "plain"),
    [
        ("1f1b", (np.int64(4), 8.0), {}, ((4, 8), {})),
        ("zbv", (np.int32(4), np.uint8(6)), {}, ((4, 6), {})),
        ("interleaved-1f1b", (8.0, 8), {"stages_per_rank": np.int64(2)}, ((8, 8), {"stages_per_rank": 2})),
        ("zb-auto", (4, 8), {"memory_limit": 8.0}, ((4, 8), {"memory_limit": 8})),
        ("zb-auto", (4, 8), {"memory_limit": np.int64(5)}, ((4, 8), {"memory_limit": 5})),
        ("zb-auto", (3, 6), {"memory_limit": np.array([5, 4, 3])}, ((3, 6), {"memory_limit": [5, 4, 3]})),
        (
            "zb-auto",
            (4, 8),
            {
                "f": np.float32(1.0),
                "b": np.float64(1.5),
                "w": [np.float32(0.5)] * 4,
                "comm": np.float16(0.25),
            },
            ((4, 8), {"f": 1.0, "b": 1.5, "w": 0.5, "comm": 0.25}),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_numpy_and_integral_values_give_the_plain_int_schedule(name, args, options, plain):
    got = build_schedule(name, *args, **options)
    want = build_schedule(name, *plain[0], **plain[1])
    assert got == want
    assert type(got.n_microbatches) is int and type(got.n_stages) is int


def test_numpy_costs_in_simulate_match_floats():
    schedule = build_schedule("zb-h1", 4, 8)
    got = simulate(schedule, np.float32(1.0), np.int64(2), np.array([1.0, 0.5, 0.5, 1.0]), np.float16(0.25))
    want = simulate(schedule, 1.0, 2.0, [1.0, 0.5, 0.5, 1.0], 0.25)
    assert (got.starts, got.ends, got.bubble_ratio) == (want.starts, want.ends, want.bubble_ratio)
    other = simulate(schedule, 1.0, 2.0, [1.0, 0.5, 0.5, 2.0], 0.25)  # not trivially equal: costs matter
    assert other.ends != want.ends


def test_zb_auto_direct_call_takes_a_numpy_memory_limit():
    assert zb_auto(4, 8, memory_limit=np.int64(5)) == zb_auto(4, 8, memory_limit=5)


@pytest.mark.parametrize(
    ("args", "options", "match"),
    [
        ((4, 8.5), {}, r"1f1b: n_microbatches must be an integer >= 1, got 8\.5 \(float\)"),
        ((True, 8), {}, r"1f1b: n_stages must be an integer >= 1, got True \(bool\)"),
        ((4, float("nan")), {}, r"n_microbatches must be an integer >= 1, got nan"),
        ((4, float("inf")), {}, r"n_microbatches must be an integer >= 1, got inf"),
        ((np.int64(0), 8), {}, r"n_stages must be an integer >= 1, got np\.int64\(0\)"),
        ((4, "8"), {}, r"n_microbatches must be an integer >= 1, got '8' \(str\)"),
    ],
)
def test_bad_counts_are_named(args, options, match):
    with pytest.raises(ValueError, match=match):
        build_schedule("1f1b", *args, **options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"memory_limit": 8.5}, r"zb-auto: memory_limit must be an integer >= 1, got 8\.5"),
        ({"memory_limit": np.bool_(True)}, r"zb-auto: memory_limit must be an integer >= 1, got np\.True_"),
        ({"memory_limit": [4, 4, 4, -1]}, r"zb-auto: memory_limit\[3\] must be an integer >= 1, got -1"),
        ({"f": float("nan")}, r"zb-auto: f must be finite and >= 0 \(a real number\), got nan"),
        ({"b": np.float32(-1.0)}, r"zb-auto: b must be finite and >= 0 .*got np\.float32\(-1\.0\)"),
        ({"w": True}, r"zb-auto: w must be a number or one number per stage, got True"),
        ({"f": "1"}, r"zb-auto: f must be a number or one number per stage, got '1' \(str\)"),
        ({"comm": float("inf")}, r"zb-auto: comm must be finite and >= 0"),
    ],
)
def test_bad_zb_auto_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        build_schedule("zb-auto", 4, 8, **options)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"f": np.float32("nan")}, r"f costs must be finite and >= 0"),
        ({"b": [1.0, True, 1.0]}, r"b costs\[1\] must be finite and >= 0 .*got True \(bool\)"),
        ({"w": None}, r"w costs must be a number or one number per stage, got None"),
        ({"comm": "0.1"}, r"comm must be finite and >= 0 .*got '0\.1' \(str\)"),
        ({"comm": np.float64(-0.5)}, r"comm must be finite and >= 0"),
    ],
)
def test_bad_simulate_costs_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(build_schedule("1f1b", 3, 3), **kwargs)


def test_build_runtime_normalises_through_build_schedule():
    with pytest.raises(ValueError, match=r"1f1b: n_microbatches must be an integer >= 1, got 2\.5"):
        build_runtime([object()], "1f1b", loss_fn=None, n_microbatches=2.5)
