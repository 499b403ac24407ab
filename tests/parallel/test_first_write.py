"""A parameter's first gradient is *written* into its zeroed ``main_grad`` slice, divided on the way.

Why: torch DDP copies each gradient into its bucket once (dividing while copying); adding into zeros and then
dividing the bucket at launch is one more pass over every gradient in the middle of backward (measured: an
add_ plus an in-place div_ of 4 MiB cost 1.7x one division written out), part of the wrapper's CPU cost over
torch's reducer. The shortcut is only right while the slice is still zero, so it is
guarded by the buffer's version counter: these tests count the writes into the gradient buffer (a dispatch
mode sees every in-place op on it), check the result is bit-identical to the add-then-divide path, and that
every way a slice can hold something else (a write into ``main_grad``, not zeroing between steps, microbatches
under ``no_sync``) falls back to adding. A one-rank gloo group in this process; ``grad_divisor = 4`` makes the
division visible (4 is a power of two, so ``4 * (g / 4) == g`` exactly).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import splitgrad
from splitgrad.parallel import DDPConfig, DistributedDataParallel
from tests.helpers import one_rank_group

F64 = torch.float64
DIVISOR = 4


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    yield from one_rank_group(tmp_path_factory)


class BufferWrites(TorchDispatchMode):
    """Counts, by op name, the in-place / ``out=`` ops that write into ``buffer``'s storage."""

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.storage = buffer.untyped_storage().data_ptr()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            written = arg.alias_info is not None and arg.alias_info.is_write
            if (
                written
                and isinstance(value, torch.Tensor)
                and value.untyped_storage().data_ptr() == self.storage
            ):
                self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **kwargs)


def _model(delay: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        splitgrad.Linear(4, 8, delay_wgrad_compute=delay, params_dtype=F64),
        torch.nn.Tanh(),
        splitgrad.Linear(8, 3, delay_wgrad_compute=delay, params_dtype=F64),
    )


def _ddp(group, delay: bool = False, *, lazy_zero: bool = True) -> DistributedDataParallel:
    ddp = DistributedDataParallel(
        _model(delay), process_group=group, grad_reduce_dtype=None, bucket_size=40, lazy_zero=lazy_zero
    )
    ddp.grad_divisor = DIVISOR
    return ddp


def _x(step: int = 0) -> torch.Tensor:
    return torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(step))


def _backward(ddp: DistributedDataParallel, x: torch.Tensor) -> collections.Counter[str]:
    with BufferWrites(ddp.grad_buffers[0].data) as writes:
        ddp(x).square().sum().backward()
        splitgrad.backward_dw(ddp)
    return writes.counts


def _grads(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    return [p.main_grad.clone() for p in ddp.module.parameters()]


def _exact(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
def test_first_gradient_written_divided_once_and_bit_identical(group, delay):
    n_params = 4
    fast = _ddp(group, delay)
    fast.zero_grad_buffer()
    writes = _backward(fast, _x())
    # One write per parameter, dividing on the way; no add, no division of the buckets at launch.
    assert writes == {"div": n_params}, writes
    fast.finish_grad_sync()
    # Negative check: touching the buffer after zeroing (adding zero changes no value) forces the add path,
    # which must give the same bits with more writes.
    slow = _ddp(group, delay, lazy_zero=False)  # lazy zeroing writes over a marked slice whatever it holds
    slow.zero_grad_buffer()
    slow.grad_buffers[0].data.add_(0.0)
    writes = _backward(slow, _x())
    assert writes["add_"] == n_params and writes["div_"] >= 1 and "div" not in writes, writes
    slow.finish_grad_sync()
    _exact(_grads(fast), _grads(slow))
    full = [4 * g for g in _grads(fast)]  # the undivided gradients, exactly (4 is a power of two)
    for g, p in zip(full, _model(delay).parameters()):
        assert g.shape == p.shape and g.abs().sum() > 0


def test_a_write_into_main_grad_is_kept(group):
    ddp = _ddp(group, lazy_zero=False)  # lazy zeroing (opt-in) writes over it: test_lazy_zero_* below
    ddp.zero_grad_buffer()
    _backward(ddp, _x())
    ddp.finish_grad_sync()
    full = [DIVISOR * g for g in _grads(ddp)]
    ddp.zero_grad_buffer()
    first = next(iter(ddp.module.parameters()))
    extra = torch.full_like(first, 0.5)
    first.main_grad.add_(extra)  # e.g. a layer that accumulates into main_grad itself
    writes = _backward(ddp, _x())
    assert writes["add_"] >= 1, writes
    ddp.finish_grad_sync()
    expected = [(extra + full[0]) / DIVISOR] + [g / DIVISOR for g in full[1:]]
    _exact(_grads(ddp), expected)


def test_not_zeroing_accumulates_and_optimizer_zero_grad_rearms(group):
    ddp = _ddp(group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)  # lr 0: the same gradients every step
    ddp.zero_grad_buffer()
    _backward(ddp, _x())
    ddp.finish_grad_sync()
    first = _grads(ddp)
    # No zeroing: the step's gradient is added to what the buffer holds (then the bucket divided, as ever).
    writes = _backward(ddp, _x())
    assert "div" not in writes, writes
    ddp.finish_grad_sync()
    _exact(_grads(ddp), [(a + DIVISOR * a) / DIVISOR for a in first])
    # optimizer.zero_grad() (set_to_none): the wrapper zeroes every slice, so the shortcut applies again.
    opt.zero_grad()
    writes = _backward(ddp, _x())
    assert writes["div"] == 4 and "add_" not in writes, writes
    ddp.finish_grad_sync()
    _exact(_grads(ddp), first)


def test_microbatches_under_no_sync_copy_then_add(group):
    ddp = _ddp(group)
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        writes = _backward(ddp, _x(0))
    assert writes == {"copy_": 4}, writes  # first contribution: written, not divided (more may come)
    writes = _backward(ddp, _x(1))
    assert writes["add_"] == 4 and "div" not in writes, writes
    ddp.finish_grad_sync()
    got = _grads(ddp)
    # The same arithmetic by hand: g0 + g1, divided once.
    ref = _ddp(group)
    parts = []
    for step in (0, 1):
        ref.zero_grad_buffer()
        _backward(ref, _x(step))
        ref.finish_grad_sync()
        parts.append([DIVISOR * g for g in _grads(ref)])
    _exact(got, [(a + b) / DIVISOR for a, b in zip(*parts)])


# -- lazy zeroing (DDPConfig.lazy_zero, opt-in) ---------------------------------------------------------------
def _stale_step(ddp: DistributedDataParallel) -> None:
    """A finished step, so that the buffer holds nonzero values when the next one zeroes it."""
    ddp.zero_grad_buffer()
    _backward(ddp, _x(7))
    ddp.finish_grad_sync()


def _reference(x: torch.Tensor, delay: bool = False) -> list[torch.Tensor]:
    """Plain autograd gradients of the same loss (float64), divided like the wrapper's."""
    model = _model(delay)
    model(x).square().sum().backward()
    return [p.grad / DIVISOR for p in model.parameters()]


def test_lazy_zero_is_the_default():
    assert DDPConfig().lazy_zero is True


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_a_write_between_zeroing_and_the_forward(group, lazy):
    # Eager zeroing adds the write to zeros (it counts); lazy zeroing would add it to the last step's values,
    # so the next forward refuses it instead of training on a wrong gradient.
    ddp = _ddp(group, lazy_zero=lazy)
    _stale_step(ddp)
    ddp.zero_grad_buffer()
    first = ddp.module[0]
    first.weight.main_grad.add_(1.0)
    if lazy:
        with pytest.raises(
            RuntimeError, match=r"between zero_grad_buffer\(\) and the forward.*lazy_zero=False"
        ):
            ddp(_x())
        return
    _backward(ddp, _x())
    ddp.finish_grad_sync()
    expected = _reference(_x())
    expected[0] = expected[0] + 1.0 / DIVISOR  # the write is averaged with the gradient it joined
    torch.testing.assert_close(_grads(ddp), expected, rtol=1e-12, atol=1e-12)


def test_lazy_zero_watch_ends_at_the_forward(group):
    # Only the window before the forward is watched: the step's own writes after it raise nothing.
    ddp = _ddp(group)
    for step in range(3):
        ddp.zero_grad_buffer()
        _backward(ddp, _x(step))
        ddp.finish_grad_sync()
        torch.testing.assert_close(_grads(ddp), _reference(_x(step)), rtol=1e-12, atol=1e-12)


def _ddp_allowing_unused(group) -> DistributedDataParallel:
    ddp = DistributedDataParallel(
        _model(False),
        process_group=group,
        grad_reduce_dtype=None,
        bucket_size=40,
        allow_unused_parameters=True,
    )
    ddp.grad_divisor = DIVISOR
    return ddp


def test_lazy_zero_refuses_an_unreported_write_into_a_marked_slice(group):
    # A layer that adds into main_grad, flags grad_added_to_main_grad and reports nothing (no hook, no .grad):
    # the slice still holds the last step's values, so its bucket refuses to reduce them.
    ddp = _ddp_allowing_unused(group)
    _stale_step(ddp)
    ddp.zero_grad_buffer()
    x = torch.randn(5, 8, dtype=F64)
    out = ddp(torch.randn(5, 4, dtype=F64))
    del out
    first = ddp.module[0].weight
    first.main_grad.add_(1.0)
    first.grad_added_to_main_grad = True
    ddp.module[2](x).square().sum().backward()
    with pytest.raises(RuntimeError, match=r"without reporting it.*lazy_zero=False"):
        ddp.finish_grad_sync()


def test_lazy_zero_writes_nothing_when_zeroing_and_gives_the_same_bits(group):
    lazy, eager = _ddp(group), _ddp(group, lazy_zero=False)
    for ddp in (lazy, eager):
        _stale_step(ddp)
    with BufferWrites(lazy.grad_buffers[0].data) as lazy_zeroing:
        lazy.zero_grad_buffer()
    with BufferWrites(eager.grad_buffers[0].data) as eager_zeroing:
        eager.zero_grad_buffer()
    assert lazy_zeroing.counts == {} and eager_zeroing.counts["zero_"] >= 1, (lazy_zeroing, eager_zeroing)
    # Not trivially passing: the lazily "zeroed" buffer still holds the last step's values until written.
    assert lazy.grad_buffers[0].data.abs().sum() > 0
    assert _backward(lazy, _x()) == {"div": 4}
    _backward(eager, _x())
    for ddp in (lazy, eager):
        ddp.finish_grad_sync()
    _exact(_grads(lazy), _grads(eager))
    torch.testing.assert_close(_grads(lazy), _reference(_x()), rtol=1e-12, atol=1e-12)


def test_lazy_zero_zeroes_an_unused_parameter_when_its_bucket_is_reduced(group):
    ddp = _ddp_allowing_unused(group)  # lazy_zero=True: the default
    _stale_step(ddp)
    first = ddp.module[0]
    ddp.zero_grad_buffer()
    stale = first.weight.main_grad.clone()
    assert stale.abs().sum() > 0  # marked zero, not zeroed (the negative check of the assertion below)
    x = torch.randn(5, 8, dtype=F64)
    (ddp.module[2](x).square().sum()).backward()  # only the last layer: the first gets no gradient
    ddp.finish_grad_sync()
    assert torch.count_nonzero(first.weight.main_grad) == 0 and torch.count_nonzero(first.bias.main_grad) == 0
    last = torch.nn.Linear(8, 3, dtype=F64)
    last.load_state_dict(ddp.module[2].state_dict())
    last(x).square().sum().backward()
    torch.testing.assert_close(ddp.module[2].weight.main_grad, last.weight.grad / DIVISOR, rtol=0, atol=0)


def _fuse(model: torch.nn.Module, on: bool) -> None:
    for layer in (model[0], model[2]):
        layer.fuse_wgrad_accumulation = on
        layer.refresh_skip_backward_post_hook()


@pytest.mark.parametrize("switch", ["fused", "fused_after_zeroing"])
def test_lazy_zero_zeroes_what_a_layer_writes_itself(group, switch):
    model = _model(False)
    if switch == "fused":
        _fuse(model, True)
    ddp = DistributedDataParallel(model, process_group=group, grad_reduce_dtype=None, bucket_size=40)
    ddp.grad_divisor = DIVISOR
    for _ in range(2):  # the second step starts from a buffer holding the first one's averages
        ddp.zero_grad_buffer()
        if switch == "fused_after_zeroing":  # the slices were only marked zero: the forward zeroes them
            _fuse(ddp.module, True)
        ddp(_x()).square().sum().backward()
        ddp.finish_grad_sync()
        if switch == "fused_after_zeroing":
            _fuse(ddp.module, False)
        torch.testing.assert_close(_grads(ddp), _reference(_x()), rtol=1e-12, atol=1e-12)
    # Negative check: the same steps with the zeroing skipped accumulate, and the comparison catches it.
    _backward(ddp, _x())
    ddp.finish_grad_sync()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_grads(ddp), _reference(_x()), rtol=1e-12, atol=1e-12)
