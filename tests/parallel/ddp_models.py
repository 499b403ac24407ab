"""Models, data and helpers shared by the DDP checks that run inside spawned ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import splitgrad
from splitgrad import ops
from splitgrad.module import LayerNormLinear
from splitgrad.parallel import DistributedDataParallel as DDP
from splitgrad.testing import plain_autograd_grads, shard

F64 = torch.float64
BATCH, D_IN, D_HID, D_OUT = 12, 8, 16, 4


def mixed_model(delay: bool, fused: bool, *, dtype: torch.dtype = F64, seed: int = 0) -> nn.Sequential:
    """splitgrad layers (Linear, LayerNormLinear) interleaved with plain torch layers."""
    torch.manual_seed(seed)
    split = {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fused, "params_dtype": dtype}
    return nn.Sequential(
        splitgrad.Linear(D_IN, D_HID, **split),
        nn.Tanh(),
        nn.Linear(D_HID, D_HID, dtype=dtype),
        LayerNormLinear(D_HID, D_HID, **split),
        nn.LayerNorm(D_HID, dtype=dtype),
        splitgrad.Linear(D_HID, D_OUT, bias=False, **split),
    )


def batch(step: int = 0, dtype: torch.dtype = F64, n: int = BATCH) -> torch.Tensor:
    return torch.randn(n, D_IN, dtype=dtype, generator=torch.Generator().manual_seed(1000 + step))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out - 0.5).square().mean()


def reference(
    step: int = 0, model_fn: Callable[..., nn.Module] = mixed_model, **kw
) -> dict[str, torch.Tensor]:
    """Float64 full-batch plain-autograd gradient in one process."""
    x = batch(step)
    return plain_autograd_grads(model_fn(False, False, dtype=F64, **kw), lambda m: loss_of(m(x)))


def assert_same_on_all_ranks(ddp: DDP) -> None:
    """Every rank holds bit-identical averaged buffers (replicas cannot drift)."""
    for buffer in ddp.grad_buffers:
        gathered = [torch.empty_like(buffer.data) for _ in range(ddp.world_size)]
        dist.all_gather(gathered, buffer.data)
        for r, other in enumerate(gathered):
            torch.testing.assert_close(
                other, buffer.data, rtol=0, atol=0, msg=lambda m, r=r: f"rank {r}: {m}"
            )


def one_step(rank: int, world: int, delay: bool, fused: bool, **ddp_kw) -> tuple[nn.Module, DDP]:
    model = mixed_model(delay, fused)
    ddp = DDP(model, grad_reduce_dtype=None, bucket_size=ddp_kw.pop("bucket_size", 300), **ddp_kw)
    loss_of(ddp(shard(batch(), rank, world))).backward()
    splitgrad.backward_dw(ddp)
    return model, ddp


# -- checks -----------------------------------------------------------------------------------------------


def deep_model(delay: bool, fused: bool, *, dtype: torch.dtype = F64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    split = {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fused, "params_dtype": dtype}
    return nn.Sequential(*(splitgrad.Linear(D_IN, D_IN, **split) for _ in range(4)))


class Tied(nn.Module):
    """One splitgrad Linear applied twice and one plain Linear applied twice in the same forward."""

    def __init__(self, delay: bool, fused: bool, *, dtype: torch.dtype = F64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.split = splitgrad.Linear(
            D_IN, D_IN, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused, params_dtype=dtype
        )
        self.plain = nn.Linear(D_IN, D_IN, dtype=dtype)
        self.head = splitgrad.Linear(D_IN, D_OUT, delay_wgrad_compute=delay, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.split(self.plain(x)))
        return self.head(self.split(self.plain(h)))


class WithUnused(nn.Module):
    def __init__(self, delay: bool, fused: bool, *, dtype: torch.dtype = F64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.used = splitgrad.Linear(D_IN, D_OUT, delay_wgrad_compute=delay, params_dtype=dtype)
        self.unused = splitgrad.Linear(D_IN, D_OUT, delay_wgrad_compute=delay, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class Routed(nn.Module):
    """Two experts; ``route`` picks one per call (data-dependent routing, different on every rank)."""

    def __init__(self, delay: bool, fused: bool, *, dtype: torch.dtype = F64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        split = {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fused, "params_dtype": dtype}
        self.experts = nn.ModuleList(splitgrad.Linear(D_IN, D_OUT, **split) for _ in range(2))

    def forward(self, x: torch.Tensor, route: int) -> torch.Tensor:
        return self.experts[route](x)


class CastTo(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def mixed_dtype_model(delay: bool, fused: bool, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    split = {"delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fused}
    return nn.Sequential(
        CastTo(torch.bfloat16),
        splitgrad.Linear(D_IN, D_HID, params_dtype=torch.bfloat16, **split),
        CastTo(torch.float32),
        nn.Linear(D_HID, D_HID),
        CastTo(F64),
        splitgrad.Linear(D_HID, D_OUT, params_dtype=F64, **split),
    )


def fusible_ops_model(delay: bool, fused: bool, *, dtype: torch.dtype = F64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    split = {"delay_wgrad_compute": delay, "accumulate_into_main_grad": fused, "dtype": dtype}
    return nn.Sequential(
        ops.Sequential(ops.Linear(D_IN, D_HID, **split), ops.GELU(), ops.Linear(D_HID, D_HID, **split)),
        nn.Tanh(),
        nn.Linear(D_HID, D_OUT, dtype=dtype),
    )
