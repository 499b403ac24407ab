"""DistributedDataParallel's options are one DDPConfig, given as ``config=`` or as keyword arguments.

Why: the nine options used to be restated in the signature, the docstring and the body (issue 12); now the
dataclass is the single source of truth, keyword arguments are forwarded into it, and ``build_runtime`` takes
the same typed config (``ddp=``) instead of a dict. A one-rank gloo group in this process (no spawn).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import splitgrad
from splitgrad.parallel import DDPConfig, DistributedDataParallel
from splitgrad.pipeline import build_runtime
from tests.helpers import one_rank_group


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    yield from one_rank_group(tmp_path_factory)


def _layer() -> torch.nn.Module:
    return splitgrad.Linear(4, 3, delay_wgrad_compute=True)


def test_config_and_keywords_build_the_same_options(group):
    config = DDPConfig(bucket_size=7, overlap_grad_reduce=False, timeout=30.0)
    with DistributedDataParallel(_layer(), process_group=group, config=config) as a:
        assert a.config is config
    with DistributedDataParallel(
        _layer(), process_group=group, bucket_size=7, overlap_grad_reduce=False, timeout=30.0
    ) as b:
        assert b.config == config
    with DistributedDataParallel(_layer(), process_group=group) as c:
        assert c.config == DDPConfig()
        assert c.config != config  # negative check: the comparison can fail


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": DDPConfig(), "bucket_size": 7}, r"not both; got \['bucket_size'\]"),
        ({"bucket_sise": 7}, r"unknown option\(s\) \['bucket_sise'\]; DDPConfig fields: \[.*'bucket_size'"),
        ({"config": {"bucket_size": 7}}, r"config must be a DDPConfig, got dict"),
        ({"bucket_size": 0}, r"bucket_size must be positive"),
        ({"first_bucket_size": -1}, r"first_bucket_size must be positive, got self.first_bucket_size=-1"),
    ],
)
def test_bad_options_are_named(kwargs, match):
    # Checked before torch.distributed is needed, so no group here.
    with pytest.raises(ValueError, match=match):
        DistributedDataParallel(_layer(), **kwargs)


def test_first_bucket_is_small_like_torch_ddp(group):
    """The first bucket (launched first) is capped at 1 MiB of fp32 like torch DDP's, the others at
    bucket_size; a wide layer last in backprop order then no longer delays the first launch."""
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(5)))  # 4 MiB per layer
    assert DDPConfig().resolved_first_bucket_size == 2**18
    assert DDPConfig(bucket_size=100).resolved_first_bucket_size == 100  # never above bucket_size
    with DistributedDataParallel(model, process_group=group) as ddp:
        sizes = [len(b.params) for b in ddp.buckets]
        assert sizes == [2, 8], sizes  # the last layer's bias and weight, then the rest (< 25 MiB)
    with DistributedDataParallel(model, process_group=group, first_bucket_size=25 * 2**18) as ddp:
        assert [len(b.params) for b in ddp.buckets] == [10]  # negative check: one bucket without the cap


def test_build_runtime_takes_a_typed_config(group):
    stages = [torch.nn.Sequential(_layer())]
    with pytest.raises(ValueError, match=r"ddp=DDPConfig\(.*\) needs a dp_group"):
        build_runtime(stages, "1f1b", n_microbatches=2, loss_fn=F.mse_loss, ddp=DDPConfig(bucket_size=7))
    rt = build_runtime(
        stages, "1f1b", n_microbatches=2, loss_fn=F.mse_loss, dp_group=group, ddp=DDPConfig(bucket_size=7)
    )
    (wrapped,) = rt.stages.values()
    assert isinstance(wrapped, DistributedDataParallel) and wrapped.config == DDPConfig(bucket_size=7)
    wrapped.close()


def test_default_group_passed_explicitly_is_not_held(group):
    # `process_group=dist.group.WORLD` (the usual spelling) must not keep the default group alive past
    # destroy_process_group(): a held reference is what made gloo abort at interpreter exit (docs/parallel.md's
    # torchrun example failed that way). A group of its own is held weakly (test_group_ref.py).
    import gc

    import torch.distributed as dist

    ddp = DistributedDataParallel(_layer(), process_group=dist.group.WORLD)
    assert ddp.process_group is dist.group.WORLD  # still used
    assert all(ref is not dist.group.WORLD for ref in gc.get_referents(ddp) + list(vars(ddp).values()))
    own = dist.new_group([0])
    held = DistributedDataParallel(_layer(), process_group=own)
    assert held.process_group is own and not any(v is own for v in vars(held).values())
    held.close()
    ddp.close()
