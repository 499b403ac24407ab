"""Pipeline stages cut from the models: the stage contract and a hand-run pipeline against the whole model.

Why: the pipeline runtime only sees a list of stages passing one tensor each way. Chained stages must compute
exactly the model, a pipeline-style run (detached boundaries, microbatches, wgrad parked in capture bundles
and run later) must give the whole model's gradients, and MoE aux losses must need nothing sent between
stages. Tied embeddings cannot be pipelined and must be refused loudly.
"""

from __future__ import annotations

import pytest
import torch

import splitgrad
from splitgrad.models import (
    GPT,
    MoEGPT,
    lm_loss,
    reference_twin,
    set_aux_loss_scale,
    split_into_stages,
    stage_layer_counts,
)
from tests.helpers import grads
from tests.models.helpers import assert_grads, batch, build, gpt_config, moe_config


def _pipeline_step(stages, microbatches, *, reverse_w: bool = False) -> None:
    """Forward every microbatch through the stages, then backward stage by stage (last first), parking each
    stage's wgrad of each microbatch in its own bundle; run the bundles afterwards (W after B)."""
    n_micro = len(microbatches)
    bundles = []
    for ids, targets in microbatches:
        inputs, outputs = [], []
        x = ids
        for stage in stages:
            x_in = x if stage.is_first else x.detach().requires_grad_()
            inputs.append(x_in)
            x = stage(x_in)
            outputs.append(x)
        loss = lm_loss(outputs[-1], targets) / n_micro
        grad = None
        for i in reversed(range(len(stages))):
            with splitgrad.capture_wgrad() as bundle:
                if i == len(stages) - 1:
                    loss.backward()
                else:
                    outputs[i].backward(grad)
            bundles.append(bundle)
            grad = inputs[i].grad
    for bundle in reversed(bundles) if reverse_w else bundles:
        bundle.run()


def _whole_model_step(model, microbatches) -> None:
    for ids, targets in microbatches:
        (lm_loss(model(ids), targets) / len(microbatches)).backward()
    splitgrad.backward_dw(model)


def test_stage_layer_counts_and_bad_cuts():
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="n_stages=5"):
        stage_layer_counts(4, 5)
    model = build(GPT, gpt_config(num_layers=3))
    with pytest.raises(ValueError, match="empty middle stage"):
        split_into_stages(model, 3, layers_per_stage=[2, 0, 1])
    with pytest.raises(ValueError, match="summing to num_layers"):
        split_into_stages(model, 2, layers_per_stage=[2, 2])
    with pytest.raises(ValueError, match="n_stages must be >= 1"):
        split_into_stages(model, 0)


def test_stages_chain_to_the_model_bitwise_and_partition_its_parameters():
    model = build(GPT, gpt_config(num_layers=3))
    stages = split_into_stages(model, 3)
    assert [list(s.layers) for s in stages] == [[0], [1], [2]]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()), "stages must partition the model"

    ids, _ = batch(model.config, batch_size=3, seq=10)
    x = ids
    for stage in stages:
        shape, dtype = stage.input_meta(3, 10)
        assert (tuple(x.shape), x.dtype) == (shape, dtype)
        x = stage(x)
        assert (tuple(x.shape), x.dtype) == stage.output_meta(3, 10)
    with torch.no_grad():
        torch.testing.assert_close(x, model(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="StageModule 1"):
        stages[1](ids)


def test_embedding_only_and_head_only_stages():
    model = build(GPT, gpt_config(num_layers=2))
    first, last = split_into_stages(model, 2, layers_per_stage=[0, 2])
    assert first.embed is not None and len(first.blocks) == 0 and first.head is None
    ids, _ = batch(model.config)
    with torch.no_grad():
        torch.testing.assert_close(last(first(ids)), model(ids), rtol=0, atol=0)


def test_tied_embeddings_cannot_be_pipelined():
    model = build(GPT, gpt_config(tie_embeddings=True))
    with pytest.raises(ValueError, match="tie_embeddings=True cannot be cut"):
        split_into_stages(model, 2)
    (only,) = split_into_stages(model, 1)
    ids, _ = batch(model.config)
    with torch.no_grad():
        torch.testing.assert_close(only(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("reverse_w", [False, True], ids=["w-in-order", "w-reversed"])
def test_pipelined_gpt_gives_whole_model_gradients(reverse_w):
    config = gpt_config(num_layers=3, delay_wgrad_compute=True)
    microbatches = [batch(config, batch_size=2, seq=8, seed=s) for s in range(3)]
    pipelined = build(GPT, config)
    whole = build(GPT, config)
    _pipeline_step(split_into_stages(pipelined, 3), microbatches, reverse_w=reverse_w)
    _whole_model_step(whole, microbatches)
    assert splitgrad.pending_wgrad(pipelined) == 0
    # In order, every gradient is summed in the same order as the whole-model run: bitwise.
    assert_grads(grads(pipelined), grads(whole), exact=not reverse_w)


def test_pipelined_moe_adds_aux_loss_without_sending_it():
    config = moe_config(num_layers=2, delay_wgrad_compute=True)
    microbatches = [batch(config, batch_size=2, seq=8, seed=s) for s in range(2)]
    model = build(MoEGPT, config)
    twin = reference_twin(model)
    set_aux_loss_scale(model, 1 / len(microbatches))
    _pipeline_step(split_into_stages(model, 2), microbatches)
    for ids, targets in microbatches:
        (twin.loss(ids, targets) / len(microbatches)).backward()
    assert_grads(grads(model), grads(twin))


def test_old_stage_name_warns_and_is_the_new_class():
    # Renamed: splitgrad.models.PipelineStage collided with torch's PipelineStage (the adapter subclasses it).
    import splitgrad.models as models

    with pytest.warns(DeprecationWarning, match="StageModule"):
        assert models.PipelineStage is models.StageModule
    assert "PipelineStage" not in models.__all__
    with pytest.raises(AttributeError, match="no attribute 'PipelineStages'"):
        models.PipelineStages  # noqa: B018
