"""The constructor steps the modules share (``splitgrad.module._layer_setup``), checked on every module.

Why: one implementation builds Linear, LayerNormLinear, LayerNormMLP and GroupedLinear (size, eps and
``sp_wgrad_input`` checks; norm and optional parameters). These tests pin what each module must still say and
register, so a change to a shared step shows up for every module that uses it.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad

BAD_ARGUMENTS = [
    (splitgrad.Linear, (0, 5), {}, "Linear needs positive sizes, got in_features=0 out_features=5"),
    (
        splitgrad.LayerNormLinear,
        (8, -1),
        {},
        "LayerNormLinear needs positive sizes, got in_features=8 out_features=-1",
    ),
    (
        splitgrad.LayerNormMLP,
        (8, 0),
        {},
        "LayerNormMLP needs positive sizes, got hidden_size=8 ffn_hidden_size=0",
    ),
    (
        splitgrad.GroupedLinear,
        (2, 0, 3),
        {},
        "GroupedLinear needs positive sizes, got num_gemms=2 in_features=0 out_features=3",
    ),
    (splitgrad.LayerNormLinear, (8, 4), {"eps": -1.0}, "LayerNormLinear: eps must be >= 0, got eps=-1.0"),
    (splitgrad.LayerNormMLP, (8, 4), {"eps": -0.5}, "LayerNormMLP: eps must be >= 0, got eps=-0.5"),
    *(
        (
            cls,
            (8, 4),
            {"sp_wgrad_input": "all"},
            f"{cls.__name__}: sp_wgrad_input must be one of ('keep', 'regather'), got sp_wgrad_input='all'",
        )
        for cls in (splitgrad.Linear, splitgrad.LayerNormLinear, splitgrad.LayerNormMLP)
    ),
]


@pytest.mark.parametrize(
    ("cls", "args", "kwargs", "message"),
    BAD_ARGUMENTS,
    ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(BAD_ARGUMENTS)],
)
def test_bad_arguments_name_the_module_and_the_values(cls, args, kwargs, message):
    with pytest.raises(ValueError) as err:
        cls(*args, **kwargs)
    assert str(err.value) == message


def test_boundary_values_are_accepted():
    # Not trivially passing: the checks reject only what is out of range (eps 0 and size 1 are valid).
    splitgrad.LayerNormLinear(1, 1, eps=0.0)
    splitgrad.LayerNormMLP(1, 1, eps=0.0, sp_wgrad_input="regather")
    splitgrad.GroupedLinear(1, 1, 1)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: splitgrad.Linear(6, 4), [("weight", (4, 6)), ("bias", (4,))]),
        (
            lambda: splitgrad.LayerNormLinear(6, 4),
            [("layer_norm_weight", (6,)), ("layer_norm_bias", (6,)), ("weight", (4, 6)), ("bias", (4,))],
        ),
        (
            lambda: splitgrad.LayerNormLinear(6, 4, bias=False, normalization="RMSNorm"),
            [("layer_norm_weight", (6,)), ("layer_norm_bias", None), ("weight", (4, 6)), ("bias", None)],
        ),
        (
            lambda: splitgrad.LayerNormMLP(6, 5, activation="swiglu"),
            [
                ("layer_norm_weight", (6,)),
                ("layer_norm_bias", (6,)),
                ("fc1_weight", (10, 6)),
                ("fc2_weight", (6, 5)),
                ("fc1_bias", (10,)),
                ("fc2_bias", (6,)),
            ],
        ),
        (
            lambda: splitgrad.LayerNormMLP(6, 5, bias=False, normalization="RMSNorm"),
            [
                ("layer_norm_weight", (6,)),
                ("layer_norm_bias", None),
                ("fc1_weight", (5, 6)),
                ("fc2_weight", (6, 5)),
                ("fc1_bias", None),
                ("fc2_bias", None),
            ],
        ),
        (
            lambda: splitgrad.GroupedLinear(2, 3, 4, bias=False),
            [("weight0", (4, 3)), ("bias0", None), ("weight1", (4, 3)), ("bias1", None)],
        ),
    ],
    ids=[
        "Linear",
        "LayerNormLinear",
        "LayerNormLinear-rms-nobias",
        "LayerNormMLP",
        "LayerNormMLP-rms-nobias",
        "GroupedLinear",
    ],
)
def test_parameters_are_registered_in_order_with_absent_ones_as_none(make, expected):
    module = make()
    got = [(name, None if p is None else tuple(p.shape)) for name, p in module._parameters.items()]
    assert got == expected
    present = [name for name, shape in expected if shape is not None]
    assert list(module.state_dict()) == present
    assert all(p.dtype == torch.get_default_dtype() for p in module.parameters())


@pytest.mark.parametrize("cls", [splitgrad.Linear, splitgrad.LayerNormLinear, splitgrad.LayerNormMLP])
def test_te_settings_are_kept(cls):
    calls = []

    class Tracker:
        def fork(self, *name):
            calls.append(name)
            return torch.random.fork_rng()

    module = cls(8, 4, return_bias=True, name="blk", get_rng_state_tracker=Tracker)
    assert (module.name, module.return_bias, module.sp_wgrad_input, module.tp_comm_overlap) == (
        "blk",
        True,
        "keep",
        True,
    )
    # The tracker was forked for the initialisation, with its default name (rng_tracker_name is Linear's only).
    assert calls == [()]
    assert f"name={module.name!r}" in repr(module)
