"""GPT with sequence parallelism (run inside the spawned gloo ranks of test_tp_linear).

``GPT(GPTConfig(tp_size=world, sequence_parallel=True))`` against the tp=1 model in float64: loss and every
gradient shard, immediate / deferred / deferred + fused ``main_grad``, after
``allreduce_sequence_parallel_grads``. Tolerance only: the sharded GEMMs, the all-gathers/reduce-scatters and
the sum of the norms' partial gradients over ranks add in a different order than the single-process model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.parallel.tensor import allreduce_sequence_parallel_grads

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _sp_model(world: int, act: str, **kw):
    from splitgrad.models import GPT, GPTConfig

    common = dict(vocab_size=17, seq_len=6, hidden_size=24, num_heads=6, ffn_hidden_size=48, activation=act,
                  params_dtype=F64, **kw)  # fmt: skip
    torch.manual_seed(3)
    ref = GPT(GPTConfig(**common))
    tp = GPT(GPTConfig(**common, tp_size=world, sequence_parallel=True), tp_group=dist.group.WORLD)
    return ref, tp


def check_gpt_sequence_parallel(rank: int, world: int) -> None:
    """SP GPT trains like tp=1: residual stream (s/tp, b, h) between blocks; every gradient shard matches."""
    from splitgrad.models import lm_loss, shard_gpt_state_dict

    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 17, (2, 6), generator=gen)
    targets = torch.randint(0, 17, (2, 6), generator=gen)
    for act, delay, fused in (("gelu", False, False), ("gelu", True, False), ("swiglu", True, True)):
        what = f"SP GPT tp={world} {act} {delay=} {fused=}"
        ref, tp = _sp_model(world, act, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
        tp.load_state_dict(shard_gpt_state_dict(ref.state_dict(), tp.config, rank, world))
        for model in (ref, tp):
            if fused:  # the split layers' weights accumulate into main_grad (biases and norms use .grad)
                for m in model.modules():
                    if isinstance(m, splitgrad.core.SplitModule):
                        for p in m.get_backward_dw_params():
                            if p.dim() == 2:
                                p.main_grad = torch.zeros_like(p)
        shapes = []
        hook = tp.blocks[0].register_forward_hook(lambda m, i, o, seen=shapes: seen.append(tuple(o.shape)))
        losses = []
        for model in (ref, tp):
            loss = lm_loss(model(ids), targets)
            loss.backward()
            splitgrad.backward_dw(model)
            losses.append(loss.detach())
        hook.remove()
        if shapes != [(6 // world, 2, 24)]:
            raise AssertionError(f"{what}: block output {shapes}, expected the sequence shard (s/tp, b, h)")
        flagged = {n for n, p in tp.named_parameters() if getattr(p, "sequence_parallel", False)}
        if not flagged or not all(
            ".qkv.layer_norm" in n or ".mlp." in n or ".proj.bias" in n for n in flagged
        ):
            raise AssertionError(f"{what}: unexpected sequence_parallel parameters {sorted(flagged)}")

        def grad(p: torch.Tensor) -> torch.Tensor:
            return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad

        expected = shard_gpt_state_dict(
            {n: grad(p) for n, p in ref.named_parameters()}, tp.config, rank, world
        )
        # Negative: before the TP all-reduce a norm's gradient is this rank's partial sum and must not match.
        name = "blocks.0.attn.qkv.layer_norm_weight"
        partial = grad(dict(tp.named_parameters())[name]).clone()
        if torch.allclose(partial, expected[name], **TOL):
            raise AssertionError(f"{what}: the partial norm gradient matched: the check cannot fail")
        reduced = allreduce_sequence_parallel_grads(tp, dist.group.WORLD)
        if reduced != len(flagged):
            raise AssertionError(f"{what}: reduced {reduced} gradients, {len(flagged)} are flagged")
        torch.testing.assert_close(losses[1], losses[0], **TOL)
        for n, p in tp.named_parameters():
            torch.testing.assert_close(
                grad(p), expected[n], **TOL, msg=lambda m, n=n, w=what: f"{w} {n}: {m}"
            )
    # Pipeline stages announce the sequence shard they pass on.
    from splitgrad.models import split_into_stages

    first, last = split_into_stages(tp, 2)
    if first.output_meta(2, 6) != ((6 // world, 2, 24), F64) or last.input_meta(2, 6) != first.output_meta(
        2, 6
    ):
        raise AssertionError(
            f"stage metas {first.output_meta(2, 6)} {last.input_meta(2, 6)}: not (s/tp, b, h)"
        )
    # A sequence the TP size does not divide is refused with a clear error.
    if world > 1:
        _, tp = _sp_model(world, "gelu")
        try:
            tp(ids[:, : 6 - 1])
        except ValueError as exc:
            if "divisible by the tensor-parallel size" not in str(exc):
                raise
        else:
            raise AssertionError("no ValueError for a sequence not divisible by tp_size")


ALL = ["check_gpt_sequence_parallel"]
