"""Rank functions of the expert-parallel tests (module-level: pickled by name by ``splitgrad.testing.spawn``).

Every check runs the single-process ``MoEGPT`` on the whole global batch on every rank (it is small and
deterministic) and the expert-parallel model on this rank's slice, then compares in float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import splitgrad
from splitgrad.models import MoEGPT, MoEMLP, lm_loss, moe_aux_loss, moe_layers
from splitgrad.parallel.expert import (
    ExpertDataParallel,
    ExpertParallelMoEGPT,
    ExpertParallelMoEMLP,
    load_full_state_dict,
)
from tests.helpers import grads
from tests.models.helpers import RTOL, batch, build, moe_config

ATOL = 1e-12


def run_model(model, ids, targets, *, delayed: bool):
    """Forward + backward (+ backward_dw); returns (cross-entropy, per-block input gradients)."""
    inputs: list[torch.Tensor] = []

    def keep(module, args):
        x = args[0]
        x.retain_grad()
        inputs.append(x)

    handles = [block.register_forward_pre_hook(keep) for block in model.blocks]
    try:
        ce = lm_loss(model(ids), targets)
    finally:
        for handle in handles:
            handle.remove()
    ce.backward()
    if delayed:
        if splitgrad.pending_wgrad(model) == 0:
            raise AssertionError("delayed model parked no wgrad work")
        splitgrad.backward_dw(model)
    if splitgrad.pending_wgrad(model):
        raise AssertionError("wgrad work left after backward_dw")
    return ce.detach(), [x.grad.clone() for x in inputs]


def full_name(model, name: str) -> str:
    """The single-process parameter name of ``name`` in the expert-parallel ``model``."""
    for prefix, m in model.named_modules():
        if isinstance(m, ExpertParallelMoEMLP) and name.startswith(f"{prefix}.fc"):
            head, _, leaf = name.rpartition(".")
            kind = leaf.rstrip("0123456789")
            return f"{head}.{kind}{m.expert_offset + int(leaf[len(kind) :])}"
    return name


def split_grouped(named: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """``named`` (tensors by parameter name of ``model``) with every single grouped expert tensor
    (``moe_single_grouped_weight``: ``fcX.weight`` ``(experts, out, in)``, ``fcX.bias`` ``(experts, out)``) split
    into the per-expert entries ``fcX.weight0 ..`` of the other layout (views), so that both layouts compare
    expert by expert under the same names (:func:`full_name` then maps an expert-parallel name to the full one)."""
    grouped = {
        f"{prefix}.{fc}.{part}"
        for prefix, m in model.named_modules()
        if isinstance(m, (MoEMLP, ExpertParallelMoEMLP)) and m.fc1.single_grouped_weight
        for fc in ("fc1", "fc2")
        for part in ("weight", "bias")
    }
    out = {}
    for name, t in named.items():
        if name in grouped:
            out.update({f"{name}{j}": row for j, row in enumerate(t.unbind(0))})
        else:
            out[name] = t
    return out


def is_expert_name(name: str) -> bool:
    """Whether ``name`` is an expert tensor of an MoE GPT (its MoE layers are ``blocks.i.mlp``)."""
    return ".mlp.fc" in name


def close(a, b, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def exactness(rank: int, world: int, cases: list[tuple[dict, int, int, str]]) -> list[dict]:
    """Per case ``(config overrides, local batch, seq, experts kind)``: the EP model vs the reference."""
    report = []
    group = dist.group.WORLD
    for overrides, local_b, seq, experts in cases:
        config = moe_config(**overrides)
        ref = build(MoEGPT, config)
        ids, targets = batch(config, batch_size=world * local_b, seq=seq)
        ref_ce, ref_inputs = run_model(ref, ids, targets, delayed=False)
        ref_total = ref_ce + moe_aux_loss(ref)
        ref_grads = split_grouped(grads(ref), ref)
        mine = slice(rank * local_b, (rank + 1) * local_b)

        results = {}
        for delayed in (False, True):
            ep = ExpertParallelMoEGPT(
                moe_config(**overrides, delay_wgrad_compute=delayed), ep_group=group, experts=experts
            )
            remapped = load_full_state_dict(ep, ref.state_dict())
            per_layer = 1 if config.moe_single_grouped_weight else config.num_experts // world
            if remapped != 2 * config.num_layers * (1 + config.bias) * per_layer:
                raise AssertionError(f"{remapped=} expert tensors remapped")
            ce, inputs = run_model(ep, ids[mine], targets[mine], delayed=delayed)
            results[delayed] = split_grouped(grads(ep), ep)
            total = (ce + moe_aux_loss(ep)).reshape(1)
            dist.all_reduce(total, group=group)
            close(total[0] / world, ref_total, "loss")
            for i, (g, r) in enumerate(zip(inputs, ref_inputs)):
                close(g / world, r[mine], f"input gradient of block {i}")
            for name, g in results[delayed].items():
                g = g.clone()
                if not is_expert_name(name):
                    dist.all_reduce(g, group=group)  # dense: the data-parallel sum
                close(g / world, ref_grads[full_name(ep, name)], name)
            for layer in moe_layers(ep):
                if sum(layer.last_tokens_per_expert) != world * local_b * seq * config.top_k:
                    raise AssertionError(f"global token count {layer.last_tokens_per_expert}")
        # The overlapped pair (one thread, one group), EP = world: bitwise as the same two microbatches in order.
        steps_pair_bitwise(
            lambda o=overrides, e=experts: ExpertParallelMoEGPT(
                moe_config(**o, delay_wgrad_compute=True), ep_group=group, experts=e
            ),
            ref,
            ids[mine],
            targets[mine],
        )
        # Delayed wgrad is the same arithmetic as immediate mode: bitwise.
        for name, g in results[True].items():
            torch.testing.assert_close(
                g, results[False][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
            )

        # Not trivially passing: this rank's first expert against the reference's *next* expert must differ.
        layer = moe_layers(ep)[0]
        wrong = f"blocks.0.mlp.fc1.weight{(layer.expert_offset + 1) % config.num_experts}"
        local = results[False]["blocks.0.mlp.fc1.weight0"] / world
        negative = bool(local.abs().sum() + ref_grads[wrong].abs().sum() > 0)  # two idle experts: both zero
        if negative:
            try:
                close(local, ref_grads[wrong], "negative")
            except AssertionError:
                pass
            else:
                raise AssertionError("a wrong expert's gradient was accepted")
        idle = [n for layer in moe_layers(ep) for n in layer.last_tokens_per_expert if n == 0]
        received = [sum(layer.last_tokens_per_expert) for layer in moe_layers(ep)]
        per_expert = [layer.last_tokens_per_expert for layer in moe_layers(ep)]
        report.append(
            {"idle_experts": len(idle), "tokens": received, "per_expert": per_expert, "negative": negative}
        )
    return report


def steps_pair_bitwise(make, ref, ids: torch.Tensor, targets: torch.Tensor) -> None:
    """``F0 B0 F1 B1 W`` against ``F0 (F1 || B0) B1 W`` (``overlapped_forward_backward``), the same microbatch
    twice (a model from ``make()`` loaded with ``ref``'s weights each time): gradients bitwise equal, and the
    pair really stepped the forward inside the backward."""
    from splitgrad.parallel.expert import overlapped_forward_backward

    runs = {}
    for overlapped in (False, True):
        model = make()
        load_full_state_dict(model, ref.state_dict())
        loss0 = lm_loss(model(ids), targets)
        if not overlapped:
            loss0.backward()
            logits1 = model(ids)
        else:
            stats: dict = {}
            logits1 = overlapped_forward_backward(model, ids, loss0, thread_stats=stats)
            if stats["forward"]["in_backward"] == 0:
                raise AssertionError(f"the pair never advanced the forward inside the backward: {stats}")
        lm_loss(logits1, targets).backward()
        splitgrad.backward_dw(model)
        runs[overlapped] = grads(model)
    for name, g in runs[True].items():
        torch.testing.assert_close(
            g, runs[False][name], rtol=0, atol=0, msg=lambda m, n=name: f"overlapped: {n}: {m}"
        )


def bad_ep_size(rank: int, world: int) -> str:
    """num_experts not divisible by the expert-parallel size: a ValueError naming both."""
    try:
        ExpertParallelMoEGPT(moe_config(num_experts=4), ep_group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("no ValueError")


def ep_groups(rank: int, world: int, ep: int):
    """``(ep_group, expert_dp_group)`` for ranks laid out EP-major: ``[0..ep)`` share their tokens' experts."""
    mine = {}
    for start in range(0, world, ep):
        ranks = list(range(start, start + ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ep"] = group
    for offset in range(ep):
        ranks = list(range(offset, world, ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["edp"] = group
    return mine["ep"], mine["edp"]


def hook_reduction(
    rank: int,
    world: int,
    ep: int,
    cases: list[tuple[dict, int, int, str, str]],
    overlap_experts: tuple[tuple[str, dict], ...] = (),
) -> list[dict]:
    """EP x expert-DP with :class:`ExpertDataParallel` against the single-process reference.

    Per case ``(config overrides, local batch, seq, experts kind, mode)``, mode one of ``immediate``,
    ``delayed``, ``fused`` (delayed + fuse_wgrad_accumulation). Then, per ``overlap_experts``
    ``(experts kind, config overrides)``, the same groups with two microbatches in the overlapped order (``overlap_dp_checks``; one spawn for both).
    """
    ep_group, edp_group = ep_groups(rank, world, ep)
    report = []
    for overrides, local_b, seq, experts, mode in cases:
        config = moe_config(**overrides)
        ref = build(MoEGPT, config)
        ids, targets = batch(config, batch_size=world * local_b, seq=seq)
        ref_ce, _ = run_model(ref, ids, targets, delayed=False)
        ref_total = ref_ce + moe_aux_loss(ref)
        ref_grads = split_grouped(grads(ref), ref)
        mine = slice(rank * local_b, (rank + 1) * local_b)

        split = {"delay_wgrad_compute": mode != "immediate", "fuse_wgrad_accumulation": mode == "fused"}
        model = ExpertParallelMoEGPT(
            moe_config(**overrides, **split), ep_group=ep_group, dp_group=dist.group.WORLD, experts=experts
        )
        load_full_state_dict(model, ref.state_dict())
        edp = wrap_expert_dp(model, edp_group)
        edp.zero_grad_buffer()
        ce = lm_loss(edp(ids[mine]), targets[mine])
        ce.backward()
        if mode != "immediate":
            splitgrad.backward_dw(edp)
        launched_before_finish = [len(ddp.launch_order) for ddp in (edp.dense, edp.expert)]
        edp.finish_grad_sync()
        total = (ce.detach() + moe_aux_loss(model)).reshape(1)
        dist.all_reduce(total)
        close(total[0] / world, ref_total, "loss")
        main_grads = split_grouped({name: p.main_grad for name, p in model.named_parameters()}, model)
        for name, g in main_grads.items():
            close(g, ref_grads[full_name(model, name)], f"{mode}/{experts}: {name}")
        # Every bucket of both groups was started by a hook (backward / backward_dw), none by finish_grad_sync.
        buckets = [len(ddp.buckets) for ddp in (edp.dense, edp.expert)]
        if launched_before_finish != buckets or min(buckets) < 2:
            raise AssertionError(f"{mode}: buckets launched early {launched_before_finish} of {buckets}")
        # Not trivially passing: the expert gradient averaged over the expert-DP group only is rejected.
        wrong = main_grads["blocks.0.mlp.fc1.weight0"]
        try:
            close(wrong * ep, ref_grads[full_name(model, "blocks.0.mlp.fc1.weight0")], "negative")
        except AssertionError:
            pass
        else:
            raise AssertionError("an expert gradient scaled by the wrong group size was accepted")
        edp.close()
        report.append({"mode": mode, "buckets": buckets})
    from tests.expert.overlap_dp_checks import overlap_with_expert_dp

    for experts, overrides in overlap_experts:
        report.append(
            {
                "mode": f"overlapped/{experts}" + ("/single" if overrides else ""),
                **overlap_with_expert_dp(rank, world, ep, ep_group, edp_group, experts, overrides),
            }
        )
    return report


def wrap_expert_dp(model, edp_group) -> ExpertDataParallel:
    """The tests' ``ExpertDataParallel``: dense parameters over every rank, small buckets, fp32/64 reductions."""
    return ExpertDataParallel(
        model, dp_group=dist.group.WORLD, expert_dp_group=edp_group, bucket_size=2000, grad_reduce_dtype=None
    )


def overlap_bitwise(rank: int, world: int, modes: list[tuple[str, str, dict]]) -> list[str]:
    """Two microbatches: ``F0 B0 F1 B1`` vs ``F0 (F1 || B0) B1`` (one thread, forward and backward on one group):
    losses and gradients bitwise equal; the pair really interleaves, in the same issue order on every rank;
    either part's error is named and leaves no exchange unwaited."""
    from splitgrad.parallel.expert import overlapped_forward_backward

    ep_group = dist.new_group(list(range(world)))
    config = moe_config()
    refs = {}

    def ref_for(overrides: dict) -> MoEGPT:
        key = tuple(sorted(overrides.items()))
        if key not in refs:
            refs[key] = build(MoEGPT, moe_config(**overrides))
        return refs[key]

    ids, targets = batch(config, batch_size=4 * world, seq=8)
    local = ids.view(world, 2, 2, -1)[rank], targets.view(world, 2, 2, -1)[rank]  # (microbatch, 2, seq)
    out = []
    for delay, experts, overrides in modes:
        single = overrides.get("moe_single_grouped_weight", False)
        runs = []
        for overlapped in (False, True):
            model = ExpertParallelMoEGPT(
                moe_config(**overrides, delay_wgrad_compute=delay == "delayed"),
                ep_group=ep_group,
                experts=experts,
            )
            load_full_state_dict(model, ref_for(overrides).state_dict())
            watch = _ExpertWatch(model)
            loss0 = lm_loss(model(local[0][0]), local[1][0])
            before_pair = len(watch.comm)
            if overlapped:
                stats: dict = {}
                logits1 = overlapped_forward_backward(model, local[0][1], loss0, thread_stats=stats)
                watch.after_pair(delayed=delay == "delayed")
                _check_pair_stats(stats, model)
            else:
                loss0.backward()
                logits1 = model(local[0][1])
            pair_log = watch.comm[before_pair:]
            if overlapped:  # the forward started once the backward's first exchange was issued
                check_backward_leads(pair_log)
                check_interleaved(pair_log)
                check_same_issue_order(pair_log, ep_group)
            else:  # not trivially passing: the in-order pair is no interleave
                try:
                    check_interleaved(pair_log)
                except AssertionError:
                    pass
                else:
                    raise AssertionError("the sequential pair's exchange log passed as interleaved")
                # ... and a forward-first log is refused by the lead check.
                try:
                    check_backward_leads([("dispatch counts", 0.0, 1.0), ("combine backward", 2.0, 3.0)])
                except AssertionError:
                    pass
                else:
                    raise AssertionError("a forward-first exchange log passed as backward-led")
            loss1 = lm_loss(logits1, local[1][1])
            loss1.backward()
            if delay == "delayed":
                splitgrad.backward_dw(model)
            watch.after_step(delayed=delay == "delayed", overlapped=overlapped)
            runs.append((torch.stack([loss0.detach(), loss1.detach()]), grads(model)))
        (la, ga), (lb, gb) = runs
        torch.testing.assert_close(lb, la, rtol=0, atol=0)
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        if delay == "delayed":  # microbatch 1's expert W was added to what ran inside the dispatch: not lost
            first = watch.snapshot
            if torch.equal(first, gb["blocks.0.mlp.fc1.weight" + ("" if single else "0")]):
                raise AssertionError("the expert gradient after the step equals microbatch 0's alone")
        out.append(f"{delay}/{experts}" + ("/single" if single else ""))
    out.append(pair_errors(ExpertParallelMoEGPT(config, ep_group=ep_group), local[0]))
    return out


def check_backward_leads(log: list) -> None:
    """The pair's exchange log ``(name, issued, waited)``: the backward issued its first exchange before the
    forward issued any (Megatron-Core's combined-1F1B order; the token-count exchange is the forward's first)."""
    forward = [s for n, s, _ in log if not n.endswith(" backward")]
    backward = [s for n, s, _ in log if n.endswith(" backward")]
    if not forward or not backward or not min(backward) < min(forward):
        raise AssertionError(f"the forward issued an exchange before the backward's first one: {log}")


def check_interleaved(log: list) -> None:
    """The pair's exchange log ``(name, issued, waited)`` shows the forward advanced inside the backward: its
    first dispatch was issued before the backward's first exchange completed, and some forward exchange was
    issued while a backward exchange was in flight."""
    forward = [(n, s, e) for n, s, e in log if n in ("dispatch", "combine")]
    backward = [(n, s, e) for n, s, e in log if n.endswith(" backward")]
    if not forward or not backward:
        raise AssertionError(f"no exchanges of both parts in {log}")
    first_dispatch = min(s for n, s, _ in forward if n == "dispatch")
    if not first_dispatch < min(e for _, _, e in backward):
        raise AssertionError(
            "the forward's first dispatch was issued after the backward's first exchange ended"
        )
    if not any(bs < fs < be for _, fs, _ in forward for _, bs, be in backward):
        raise AssertionError("no forward exchange was issued while a backward exchange was in flight")


def check_same_issue_order(log: list, group) -> None:
    """Every rank issued the pair's dispatch/combine exchanges (both directions) in the same order."""
    order = [n for n, _, _ in sorted(log, key=lambda entry: entry[1]) if n != "dispatch counts"]
    orders: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(orders, order, group=group)
    if any(o != orders[0] for o in orders):
        raise AssertionError(f"issue orders differ between ranks: {orders}")


def pair_errors(model, inputs) -> str:
    """An error in either part of the pair is named, and the exchange the other part had in flight is waited
    (logged) before the error surfaces; the group works afterwards."""
    from splitgrad.parallel.expert import overlapped_forward_backward

    log: list = []
    for layer in moe_layers(model):
        layer.comm_log = log
    ids = inputs[0]
    # Backward part fails at once (dy of the wrong shape): before its first exchange, so before the forward
    # started; nothing was issued.
    logits = model(ids)
    log.clear()
    try:
        overlapped_forward_backward(model, ids, logits, torch.ones(1, dtype=logits.dtype))
    except RuntimeError as exc:
        if "backward part failed" not in str(exc) or log:
            raise AssertionError(f"backward failure: {exc}; exchanges waited {log}") from exc
    else:
        raise AssertionError("a failing backward part was not reported")
    # Backward part fails in the first block, after the second block's exchanges advanced the forward twice:
    # the forward's combine still in flight is waited before the error surfaces.
    handle = model.blocks[0].register_full_backward_pre_hook(
        lambda *_: (_ for _ in ()).throw(KeyError("late"))
    )
    loss = lm_loss(model(ids), inputs[1])
    handle.remove()
    log.clear()
    try:
        overlapped_forward_backward(model, ids, loss)
    except RuntimeError as exc:
        waited = [n for n, _, _ in sorted(log, key=lambda entry: entry[1])]
        if "backward part failed" not in str(exc) or waited != [
            "combine backward",
            "dispatch counts",
            "dispatch",
            "dispatch backward",
            "combine",
        ]:
            raise AssertionError(f"late backward failure: {exc}; exchanges waited {waited}") from exc
    else:
        raise AssertionError("a failing backward part was not reported")
    # Forward part fails in its second block, advanced from inside the backward's exchanges.
    loss = lm_loss(model(ids), inputs[1])
    handle = model.blocks[1].attn.register_forward_pre_hook(
        lambda *_: (_ for _ in ()).throw(KeyError("boom"))
    )
    try:
        overlapped_forward_backward(model, ids, loss)
    except RuntimeError as exc:
        if "forward part failed" not in str(exc) or not isinstance(exc.__cause__, KeyError):
            raise AssertionError(f"forward failure reported as {exc!r}") from exc
    else:
        raise AssertionError("a failing forward part was not reported")
    finally:
        handle.remove()
    check = torch.ones(1)
    dist.all_reduce(check, group=model.blocks[0].mlp.ep_group)  # the group is not left mid-collective
    return "errors named"


def _check_pair_stats(stats: dict, model) -> None:
    """``thread_stats`` of a pair: one thread; the backward started first and every forward step but the
    last ran inside a backward exchange (two per MoE layer); the forward's end ran after the backward."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)]
    forward, backward, pair = stats["forward"], stats["backward"], stats["pair"]
    if forward["steps"] != 2 * len(layers) or forward["in_backward"] != 2 * len(layers):
        raise AssertionError(f"forward steps {forward} for {len(layers)} MoE layers")
    spans = (pair["start"], backward["start"], forward["start"], backward["end"], forward["end"], pair["end"])
    if list(spans) != sorted(spans) or forward["start"] == backward["start"]:
        raise AssertionError(f"step spans out of order: {stats}")
    if not (forward["cpu"] > 0 and backward["cpu"] > 0 and forward["num_threads"] == 1):
        raise AssertionError(f"step stats {stats}")


class _ExpertWatch:
    """Counts wgrad-hook fires per expert module and checks where the deferred expert W ran.

    With delayed wgrad, the overlapped pair must run microbatch 0's expert W inside each layer's backward
    dispatch all-to-all (between starting and waiting for it, same thread: a strict order), leave the dense
    layers' W deferred, and fire each expert module's hooks exactly once per microbatch.
    """

    def __init__(self, model) -> None:
        self.model, self.fires, self.snapshot = model, {}, None
        self.layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoEMLP)]
        self.comm: list = []
        self.wlog: list = []
        for i, layer in enumerate(self.layers):
            layer.comm_log, layer.wgrad_log = self.comm, self.wlog
            for fc in ("fc1", "fc2"):
                key = f"{i}.{fc}"
                self.fires[key] = 0
                getattr(layer, fc).register_wgrad_accumulation_and_reduce_hooks(
                    lambda key=key: self.fires.__setitem__(key, self.fires[key] + 1)
                )

    def after_pair(self, *, delayed: bool) -> None:
        if not delayed:
            return
        for layer in self.layers:
            for fc in (layer.fc1, layer.fc2):
                if fc.wgrad_store.outstanding.total:
                    raise AssertionError(f"expert W still owed after the pair: {fc.wgrad_store.outstanding}")
            if layer.wgrad_in_dispatch:
                raise AssertionError("wgrad_in_dispatch left on after overlapped_forward_backward")
        dense = [m for _, m in splitgrad.split_modules(self.model) if m.wgrad_store.outstanding.total]
        if not dense:
            raise AssertionError("the dense layers' W ran early too")
        if set(self.fires.values()) != {1}:
            raise AssertionError(f"hooks after the pair: {self.fires}")
        dispatches = [(s, e) for name, s, e in self.comm if name == "dispatch backward"]
        if len(self.wlog) != len(self.layers):
            raise AssertionError(f"{len(self.wlog)} expert W runs logged for {len(self.layers)} layers")
        for _, ws, we in self.wlog:
            if not any(ds <= ws and we <= de for ds, de in dispatches):
                raise AssertionError(f"expert W [{ws}, {we}] not inside a dispatch backward {dispatches}")
        self.snapshot = self.layers[0].fc1.grouped_params().weights[0].grad.clone()

    def after_step(self, *, delayed: bool, overlapped: bool) -> None:
        if splitgrad.pending_wgrad(self.model):
            raise AssertionError("wgrad work left after the step")
        expected = 2 if delayed else 0  # hooks fire only for written (deferred) gradients
        if set(self.fires.values()) != {expected}:
            raise AssertionError(f"hook fires per expert module {self.fires}, expected {expected} each")
        if delayed and not overlapped and self.wlog:
            raise AssertionError("expert W ran inside the dispatch in the in-order run")
