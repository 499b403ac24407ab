"""Rank functions of the HF pipeline / expert-parallel tests (module-level: pickled by name by ``spawn``).

Tiny random transformers v5 decoders built from configs here (no download), float64; every rank builds the
same seeded model, runs the single-process reference on the whole batch and its own part of the parallel run,
and compares the loss and every gradient it holds. The union of the ranks' checked parameters must be the
whole model (no gradient left unchecked).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.integrations.transformers.pipeline_stages import HFDecoderStage, hf_pipeline_stages
from splitgrad.models import lm_loss
from splitgrad.pipeline import build_runtime

RTOL, ATOL = 1e-10, 1e-12
SMALL = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
FAMILIES = {
    "llama": {},
    # Sliding-window layers (window 4 < seq 8) next to full ones: each stage must rebuild both masks.
    "qwen3": {"layer_types": ["full_attention", "sliding_attention"] * 2, "use_sliding_window": True,
              "sliding_window": 4, "max_window_layers": 0},
    "qwen3_moe": {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
    # One sliding-window mask for every layer (Mixtral's rule).
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
}  # fmt: skip
MOE = ("qwen3_moe", "mixtral")


def tiny_model(family: str):
    """The family's tiny float64 model in training mode (seeded: the same on every rank and every call)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = CONFIG_MAPPING[family](**{**SMALL, **FAMILIES[family]})
    # transformers' default grouped_mm refuses float64 on the CPU: the reference runs the eager experts.
    kwargs = {"experts_implementation": "eager"} if family in MOE else {}
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64, **kwargs).train()


def tokens(batch: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, next-token targets)``, both ``(batch, seq)`` int64."""
    ids = torch.randint(3, SMALL["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_all_checked(mine: list[str], every: list[str], what: str) -> None:
    """The ranks' checked names together are every name, each once."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(mine))
    union = [n for names in gathered for n in names]
    if sorted(union) != sorted(every):
        missing, twice = sorted(set(every) - set(union)), sorted({n for n in union if union.count(n) > 1})
        raise AssertionError(f"{what}: gradients unchecked {missing}, checked twice {twice}")


def pipeline_exact(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict]:
    """Per ``(family, schedule)``: the converted model (deferred W) cut by ``hf_pipeline_stages`` and run by the
    runtime (``zbv``: two stages per rank) against the unconverted model on the whole batch."""
    report = []
    ids, targets = tokens()
    for family, schedule in cases:
        ref = tiny_model(family)
        model = splitgrad.convert(copy.deepcopy(ref), delay_wgrad_compute=True)
        ref_loss = lm_loss(ref(input_ids=ids).logits, targets)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}

        n_stages = world * (2 if schedule == "zbv" else 1)
        stages = hf_pipeline_stages(model, n_stages)
        with build_runtime(stages, schedule, n_microbatches=4, loss_fn=lm_loss) as rt:
            result = rt.step(ids, targets)
            close(result.loss, ref_loss.detach(), f"{family}/{schedule}: loss")
            if result.w_tasks == 0:
                raise AssertionError(f"{family}/{schedule}: the W steps ran no deferred work")
            if splitgrad.pending_wgrad(model):
                raise AssertionError(f"{family}/{schedule}: wgrad work left after the step")
            names = {id(p): n for n, p in model.named_parameters()}
            checked = []
            for p in rt.parameters():
                name = names[id(p)]
                close(p.grad, ref_grads[name], f"{family}/{schedule}: {name}")
                checked.append(name)
        check_all_checked(checked, list(ref_grads), f"{family}/{schedule}")
        report.append({"case": f"{family}/{schedule}", "params": len(checked), "w_tasks": result.w_tasks})
        # Not trivially passing: the gradient of another microbatch split (the first half of the batch) differs.
        if rank == 0 and not report[-1].get("negative"):
            half = tiny_model(family)
            lm_loss(half(input_ids=ids[:2]).logits, targets[:2]).backward()
            name = checked[0]
            try:
                close(dict(half.named_parameters())[name].grad, ref_grads[name], "negative")
            except AssertionError:
                report[-1]["negative"] = True
            else:
                raise AssertionError("a gradient of half the batch was accepted")
    if rank == 0:  # the sliding-window mask matters here: stages that build only full masks differ
        model = tiny_model("mixtral")
        want = model(input_ids=ids).logits
        (stage,) = hf_pipeline_stages(model, 1)
        full = HFDecoderStage(
            model.config, list(stage.layers), ["full_attention"] * len(stage.layers), stage.rotary_emb,
            embed=stage.embed_tokens, norm=stage.norm, lm_head=stage.lm_head,
        )  # fmt: skip
        close(stage(ids), want, "one stage")
        if torch.allclose(full(ids), want, rtol=RTOL, atol=ATOL):
            raise AssertionError("full masks gave the sliding-window model's logits: the mask is not tested")
        report.append({"case": "sliding mask matters"})
    return report


def expert_parallel_exact(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict]:
    """Per ``(family, mode)``: the converted model with its experts sharded by ``shard_hf_experts`` over every
    rank (this rank's slice of the batch) against the unconverted model on the whole batch. ``mode``:
    ``immediate``, ``delayed`` (W at ``backward_dw``), ``in-dispatch`` (delayed, the experts' W inside the
    backward's dispatch all-to-all) or ``edp`` (in-dispatch, the gradients averaged by ``ExpertDataParallel``, as
    examples/hf_moe.py trains)."""
    from splitgrad.integrations.transformers import ExpertParallelExperts, shard_hf_experts
    from splitgrad.parallel.expert import ExpertDataParallel

    singles = [dist.new_group([r]) for r in range(world)]  # expert-DP groups: each rank holds its own experts

    group = dist.group.WORLD
    ids, targets = tokens()
    local_b = ids.shape[0] // world
    mine = slice(rank * local_b, (rank + 1) * local_b)
    report, runs = [], {}
    for family, mode in cases:
        ref = tiny_model(family)
        ref_loss = lm_loss(ref(input_ids=ids).logits, targets)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}

        delayed = mode != "immediate"
        model = splitgrad.convert(copy.deepcopy(ref), delay_wgrad_compute=delayed)
        sharded = shard_hf_experts(model, group)
        layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
        for layer in layers:
            layer.wgrad_in_dispatch = mode in ("in-dispatch", "edp")
        edp = None
        if mode == "edp":
            edp = ExpertDataParallel(model, dp_group=group, expert_dp_group=singles[rank])
            edp.zero_grad_buffer()
        ce = lm_loss((edp or model)(input_ids=ids[mine]).logits, targets[mine])
        ce.backward()
        if delayed:
            owed = [layer.local.wgrad_store.outstanding.total for layer in layers]
            if (mode in ("in-dispatch", "edp")) != (sum(owed) == 0) or splitgrad.pending_wgrad(model) == 0:
                raise AssertionError(f"{family}/{mode}: expert W owed after backward {owed}")
            splitgrad.backward_dw(edp or model)
        if edp is not None:
            edp.finish_grad_sync()
        if splitgrad.pending_wgrad(model):
            raise AssertionError(f"{family}/{mode}: wgrad work left after backward_dw")
        total = ce.detach().reshape(1)
        dist.all_reduce(total, group=group)
        close(total[0] / world, ref_loss.detach(), f"{family}/{mode}: loss")
        checked, grads_here = [], {}
        for name, p in model.named_parameters():
            g = p.grad.clone() if edp is None else p.main_grad * world  # the wrapper's data-parallel average
            if getattr(p, "expert_parallel", False):  # this rank's rows of the full gradient
                layer = model.get_submodule(name.rpartition(".local.")[0])
                full = name.replace(".local.", ".")
                want = ref_grads[full][layer.expert_offset : layer.expert_offset + layer.local_experts]
                checked.append(f"{full}[{layer.expert_offset // layer.local_experts}]")  # its ep rank
            else:  # dense: the data-parallel sum
                if edp is None:
                    dist.all_reduce(g, group=group)
                want, full = ref_grads[name], name
                checked.append(f"{full}[{rank}]")
            close(g / world, want, f"{family}/{mode}: {name}")
            grads_here[name] = g
        # Every gradient of the model checked: each dense one and each expert row block on exactly one rank.
        check_all_checked(checked, [f"{n}[{r}]" for n in ref_grads for r in range(world)], f"{family}/{mode}")
        runs[family, mode] = grads_here
        # Not trivially passing: this rank's expert gradient against the other rank's rows is rejected.
        name = next(n for n in grads_here if ".local." in n)
        layer = model.get_submodule(name.rpartition(".local.")[0])
        other = (layer.expert_offset + layer.local_experts) % layer.num_experts
        try:
            close(
                grads_here[name] / world,
                ref_grads[name.replace(".local.", ".")][other : other + layer.local_experts],
                "negative",
            )
        except AssertionError:
            negative = True
        else:
            raise AssertionError("another rank's expert gradient was accepted")
        report.append({"case": f"{family}/{mode}", "sharded": len(sharded), "negative": negative})
        if edp is not None:
            edp.close()
    # Deferred W (at backward_dw or inside the dispatch) is the same arithmetic as immediate: bitwise.
    for (family, mode), got in runs.items():
        base = runs.get((family, "immediate"))
        if base is not None and mode in ("delayed", "in-dispatch"):
            for name, g in got.items():
                torch.testing.assert_close(
                    g, base[name], rtol=0, atol=0, msg=lambda m, n=f"{mode}: {name}": f"{n}: {m}"
                )
    return report
