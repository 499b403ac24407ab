"""torchtitan's zero-bubble recipes, run with splitgrad layers, against the real torchtitan package.

Why: torchtitan switched off its ``pp_zbv``, ``pp_looped_zero_bubble`` and ``pp_custom_csv`` integration tests
because PyTorch's split backward (``stage_backward_input``) failed on the FlexAttention ``BlockMask`` its
stages receive. These tests run the same recipes (``ZBVZeroBubble``, ``InterleavedZeroBubble``, a CSV
``_PipelineScheduleRuntime``; full activation checkpointing; one ``BlockMask`` per microbatch) on torchtitan's
llama3 debug model split by torchtitan's own helpers, with splitgrad's linears and W step, on 2 gloo ranks,
and require the losses and every gradient of the one-process model.

They also pin down what changed upstream: the helper that raised torchtitan's error still raises it on a
``BlockMask``, but torch 2.13's ``stage_backward_input`` no longer hands it one (pytorch/pytorch#182182), so
PyTorch's own split runs these stages too. If that regresses, :func:`test_torch_2_13_split_skips_the_mask`
fails.

On CPU, FlexAttention's backward needs :func:`splitgrad.testing.flex_cpu.torchtitan_flex_on_cpu` (torch's
eager flex_attention; checked here against SDPA on the same mask).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import splitgrad
from splitgrad.integrations.torchtitan import convert_linears
from splitgrad.testing import spawn
from splitgrad.testing.flex_cpu import torchtitan_flex_on_cpu
from tests.integrations import titan_tiny, torchtitan_checks


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return spawn(torchtitan_checks.run_checks, 2, torchtitan_checks.ALL, timeout=600, pg_timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*torchtitan_checks.ALL, "mask_matters"])
def test_two_ranks(results, name):
    failures = [f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None]
    assert not failures, "\n".join(failures)


def test_convert_linears_takes_torchtitans_linear():
    from torchtitan.models.common import Linear as TitanLinear

    model = titan_tiny.debug_model(n_layers=1)
    before = {n: p for n, p in model.named_parameters()}
    titan = [n for n, m in model.named_modules() if isinstance(m, TitanLinear)]
    assert titan, "the debug model has no torchtitan Linear"
    convert_linears(model)
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(n for n, _ in splitgrad.split_modules(model)) == sorted(titan)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(m.need_backward_dw() for _, m in splitgrad.split_modules(model))


def test_convert_linears_refuses_a_subclass_that_overrides_forward():
    # torchtitan's own ScaledBiasRowwiseLinear scales its bias contribution in forward: not x @ W.T + b.
    from torchtitan.models.common.linear import ScaledBiasRowwiseLinear

    layer = ScaledBiasRowwiseLinear(ScaledBiasRowwiseLinear.Config(in_features=4, out_features=3, bias=True))
    model = nn.Sequential(nn.Linear(3, 4), layer)
    with pytest.raises(ValueError, match=r"\['1 \(ScaledBiasRowwiseLinear\)'\] subclass nn.Linear"):
        convert_linears(model)
    assert type(model[0]) is nn.Linear, "nothing may be converted when it raises"


def test_eager_flex_on_cpu_equals_sdpa_on_the_same_mask():
    """The CPU stand-in computes FlexAttention's value and gradients (float64, document mask)."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    model = titan_tiny.debug_model(n_layers=1)
    with torchtitan_flex_on_cpu():
        mask = model.get_attention_masks(titan_tiny.packed_positions([40], seq=128)[0])
        dense = create_mask(mask.mask_mod, 1, None, 128, 128)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(1, 2, 128, 16, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "qkv"
        )
        flex = flex_attention(q, k, v, block_mask=mask)
        (g_flex := torch.autograd.grad(flex.square().sum(), (q, k, v)))
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        g_sdpa = torch.autograd.grad(sdpa.square().sum(), (q, k, v))
    torch.testing.assert_close(flex, sdpa, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_flex, g_sdpa):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Negative check: without the document boundary the result differs.
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(flex, causal, atol=1e-6)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, k, v, block_mask=mask)  # restored on exit: torch's own refusal is back


def test_torch_2_13_split_skips_the_mask():
    """torchtitan's failure, reproduced where it came from, and the torch 2.13 code path that avoids it."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input

    model = titan_tiny.debug_model(n_layers=1)
    with torchtitan_flex_on_cpu():
        mask = model.get_attention_masks(titan_tiny.packed_positions([40], seq=128)[0])
        # The helper that raised "'BlockMask' object has no attribute 'requires_grad'" in torchtitan's CI:
        with pytest.raises(AttributeError, match="'BlockMask' object has no attribute 'requires_grad'"):
            _get_grad_fn_or_grad_acc(mask)
        block = model.layers["0"]
        x = torch.randn(1, 128, model.config.dim, dtype=torch.float64, requires_grad=True)
        out = block(x, mask, titan_tiny.packed_positions([40], seq=128)[0])
        grads, _ = stage_backward_input([out], [torch.ones_like(out)], [x, mask], block.parameters())
    assert grads[0] is not None and grads[0].shape == x.shape and grads[1] is None
