"""The single-process names of an expert-parallel model's tensors (what checkpoints key by) and the weights it
loads from the single-process model, on a one-rank expert group (no spawn: the names depend only on the layout).

Why: a name-keyed checkpoint is only safe when every name says exactly which tensor it holds. An expert-parallel
layer with one grouped weight holds *rows* of the full ``fcX.weight``, which no name says: the ranks would write
the same key with different contents, so :func:`full_state_names` must refuse it, while
:func:`load_full_state_dict` (which can slice) must still load it.
"""

from __future__ import annotations

import pytest
import torch

from splitgrad.models import MoEConfig, MoEGPT
from splitgrad.parallel.expert import ExpertParallelMoEGPT, full_state_names, load_full_state_dict
from tests.helpers import one_rank_group


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    yield from one_rank_group(tmp_path_factory)


def _config(single: bool) -> MoEConfig:
    return MoEConfig(
        vocab_size=16, seq_len=4, hidden_size=8, num_heads=2, num_experts=2, params_dtype=torch.float64,
        moe_single_grouped_weight=single,
    )  # fmt: skip


def test_per_expert_tensors_map_to_their_global_names(group):
    torch.manual_seed(0)
    model = ExpertParallelMoEGPT(_config(False), ep_group=group)
    names = full_state_names(model)
    full = MoEGPT(_config(False)).state_dict()
    assert set(names.values()) == set(full), "every tensor needs exactly the single-process model's name"
    assert load_full_state_dict(model, full) > 0
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, full[names[key]], rtol=0, atol=0)


def test_single_grouped_experts_load_but_are_refused_a_name(group):
    torch.manual_seed(0)
    model = ExpertParallelMoEGPT(_config(True), ep_group=group)
    full = MoEGPT(_config(True)).state_dict()
    assert load_full_state_dict(model, full) > 0
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"full_state_names: '.*fc1\.weight' holds rows \[0, 2\)"):
        full_state_names(model)
