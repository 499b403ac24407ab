"""Checks run inside spawned gloo ranks for tensor-parallel ``splitgrad.Linear`` (imported by the children).

Every check compares the sharded layer against the single-process float64 layer holding the full weight
(output, input gradient per shard, every weight/bias gradient slice), and each other mode against the TP
layer's own immediate mode (:func:`vs_immediate`): bitwise where both run the same operations in the same
order, float64-tight where the fused path runs another kernel. ``run_checks`` runs a list of checks in one
process group and returns ``{check: None | remote traceback}``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import splitgrad
from tests.helpers import expect_error

F64 = torch.float64
S, B, IN, OUT = 6, 2, 12, 18  # sequence, batch, features: divisible by 2 and 3 ranks
TOL = {"rtol": 1e-12, "atol": 1e-12}
EXACT = {"rtol": 0, "atol": 0}


@dataclass
class Reference:
    """The full layer in float64 and its gradients for two microbatches (summed, as accumulation does)."""

    w: torch.Tensor  # (OUT, IN)
    b: torch.Tensor  # (OUT,)
    xs: list[torch.Tensor]  # per microbatch (S, B, IN)
    gs: list[torch.Tensor]  # per microbatch output gradients (S, B, OUT)
    ys: list[torch.Tensor]
    dxs: list[torch.Tensor]
    dw: torch.Tensor
    db: torch.Tensor


def reference(n_micro: int = 2) -> Reference:
    gen = torch.Generator().manual_seed(1234)  # identical on every rank
    w = torch.randn(OUT, IN, generator=gen, dtype=F64)
    b = torch.randn(OUT, generator=gen, dtype=F64)
    xs = [torch.randn(S, B, IN, generator=gen, dtype=F64) for _ in range(n_micro)]
    gs = [torch.randn(S, B, OUT, generator=gen, dtype=F64) for _ in range(n_micro)]
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    ys, dxs = [], []
    for x, g in zip(xs, gs):
        xr = x.clone().requires_grad_()
        y = F.linear(xr, wr, br)
        (y * g).sum().backward()
        ys.append(y.detach())
        dxs.append(xr.grad)
    return Reference(w, b, xs, gs, ys, dxs, wr.grad, br.grad)


def _slices(mode: str, sp: bool, rank: int, world: int) -> dict[str, slice]:
    s_loc, o_loc, i_loc = S // world, OUT // world, IN // world
    seq = slice(rank * s_loc, (rank + 1) * s_loc) if sp else slice(None)
    if mode == "column":
        out = slice(rank * o_loc, (rank + 1) * o_loc)
        return {
            "x_seq": seq,
            "x_feat": slice(None),
            "y_seq": slice(None),
            "y_feat": out,
            "w": (out, slice(None)),
        }
    inp = slice(rank * i_loc, (rank + 1) * i_loc)
    return {"x_seq": slice(None), "x_feat": inp, "y_seq": seq, "y_feat": slice(None), "w": (slice(None), inp)}


def build(mode: str, sp: bool, ref: Reference, rank: int, world: int, **kw) -> splitgrad.Linear:
    layer = splitgrad.Linear(
        IN, OUT, tp_group=dist.group.WORLD, tp_size=world, parallel_mode=mode, sequence_parallel=sp,
        params_dtype=F64, **kw,
    )  # fmt: skip
    sl = _slices(mode, sp, rank, world)
    with torch.no_grad():
        layer.weight.copy_(ref.w[sl["w"]])
        layer.bias.copy_(ref.b[sl["y_feat"]] if mode == "column" else ref.b)
    return layer


def run(layer: splitgrad.Linear, mode: str, sp: bool, ref: Reference, rank: int, world: int, how: str, order):
    """Forward+backward both microbatches; W per ``how``; returns local outputs, dx, grads, B->W bytes."""
    sl = _slices(mode, sp, rank, world)
    ys, dxs, bundles = [], [], []
    for x, g in zip(ref.xs, ref.gs):
        x_loc = x[sl["x_seq"]][..., sl["x_feat"]].clone().requires_grad_()
        with splitgrad.capture_wgrad() if how == "bundles" else _null() as bundle:
            y = layer(x_loc)
            (y * g[sl["y_seq"]][..., sl["y_feat"]]).sum().backward()
        if bundle is not None:
            bundles.append(bundle)
        ys.append(y.detach())
        dxs.append(x_loc.grad)
    held = sum(b.saved_bytes() for b in bundles) if bundles else None
    if how == "bundles":
        for i in order:
            bundles[i].run()
    elif how == "backward_dw":
        if layer.weight.grad is not None or splitgrad.pending_wgrad(layer) != len(ref.xs):
            raise AssertionError(f"deferred: {splitgrad.pending_wgrad(layer)=} grad={layer.weight.grad}")
        splitgrad.backward_dw(layer)
    splitgrad.ensure_no_pending_wgrad(layer)
    dw = layer.weight.main_grad if layer.fuse_wgrad_accumulation else layer.weight.grad
    return {"y": ys, "dx": dxs, "dw": dw.clone(), "db": layer.bias.grad.clone(), "held": held}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _close(name, actual, expected, tol) -> None:
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{name}: {m}")


def vs_immediate(kw: dict) -> dict:
    """The tolerance of a mode's weight gradients against immediate mode's.

    Delayed mode writes ``.grad`` with the very ``mm`` and ``add_`` immediate mode's autograd runs, in the same
    (or, for two microbatches, a commuting) order: bitwise. Fused mode promises no weight-sized temporary, so it
    adds each microbatch with one ``addmm_`` into ``main_grad`` where immediate mode runs ``mm`` and then
    ``add_``: the same sum through another BLAS kernel, whose rounding depends on the kernel the CPU dispatches
    to (an AVX-512 MKL accumulates into C differently from AVX2). Float64-tight there, never bitwise.
    """
    return TOL if kw.get("fuse_wgrad_accumulation") else EXACT


def check_linear_exactness(rank: int, world: int) -> None:
    """column/row x SP x immediate/delayed/fused/delayed+fused (x keep/regather): exact vs the full layer."""
    ref = reference()
    order = torch.randperm(len(ref.xs), generator=torch.Generator().manual_seed(7)).tolist()
    order = order if order != sorted(order) else order[::-1]  # a random order that is not the forward order
    for mode in ("column", "row"):
        for sp in (False, True):
            sl = _slices(mode, sp, rank, world)
            base = None
            variants = [("immediate", {}, "none"), ("delayed", {"delay_wgrad_compute": True}, "backward_dw")]
            variants += [("fused", {"fuse_wgrad_accumulation": True}, "none")]
            variants += [
                ("delayed+fused", {"delay_wgrad_compute": True, "fuse_wgrad_accumulation": True}, "bundles")
            ]
            variants += [("delayed, bundles", {"delay_wgrad_compute": True}, "bundles")]
            if mode == "column" and sp:
                variants += [
                    ("regather", {"delay_wgrad_compute": True, "sp_wgrad_input": "regather"}, "backward_dw"),
                    (
                        "regather, bundles",
                        {"delay_wgrad_compute": True, "sp_wgrad_input": "regather"},
                        "bundles",
                    ),
                ]
            for label, kw, how in variants:
                what = f"{mode=} {sp=} {label}"
                layer = build(mode, sp, ref, rank, world, **kw)
                if kw.get("fuse_wgrad_accumulation"):
                    layer.weight.main_grad = torch.zeros_like(layer.weight)
                got = run(layer, mode, sp, ref, rank, world, how, order)
                for i in range(len(ref.xs)):
                    _close(f"{what} y[{i}]", got["y"][i], ref.ys[i][sl["y_seq"]][..., sl["y_feat"]], TOL)
                    _close(f"{what} dx[{i}]", got["dx"][i], ref.dxs[i][sl["x_seq"]][..., sl["x_feat"]], TOL)
                _close(f"{what} dW", got["dw"], ref.dw[sl["w"]], TOL)
                db = got["db"].clone()
                if mode == "row" and sp:
                    if not getattr(layer.bias, "sequence_parallel", False):
                        raise AssertionError(f"{what}: the row bias lacks sequence_parallel=True")
                    dist.all_reduce(db)  # what Megatron does for sequence_parallel parameters
                elif getattr(layer.bias, "sequence_parallel", False):
                    raise AssertionError(f"{what}: bias.sequence_parallel set where its gradient is complete")
                _close(f"{what} db", db, ref.db[sl["y_feat"]] if mode == "column" else ref.db, TOL)
                if base is None:
                    base = got
                    continue
                _close(f"{what} dw vs immediate", got["dw"], base["dw"], vs_immediate(kw))
                _close(f"{what} db vs immediate", got["db"], base["db"], EXACT)  # .grad in every mode
                for i in range(len(ref.xs)):
                    _close(f"{what} dx[{i}] vs immediate", got["dx"][i], base["dx"][i], EXACT)


def check_wrong_answers_rejected(rank: int, world: int) -> None:
    """Negative: a neighbour's shard, or a row-SP bias gradient without its all-reduce, fails the comparison."""
    ref = reference(1)
    other = (rank + 1) % world
    for mode in ("column", "row"):
        layer = build(mode, True, ref, rank, world)
        got = run(layer, mode, True, ref, rank, world, "none", [])
        wrong = ref.dw[_slices(mode, True, other, world)["w"]]
        if torch.allclose(got["dw"], wrong, **TOL):
            raise AssertionError(f"{mode}: dW matches the neighbour's shard, the check cannot fail")
        if mode == "row" and torch.allclose(got["db"], ref.db, **TOL):
            raise AssertionError(
                "row SP: the partial bias gradient equals the full one, the check cannot fail"
            )


def check_sp_bytes_held(rank: int, world: int) -> dict:
    """Deferred column SP: keep holds dy + the gathered input until W, regather dy + the local shard."""
    ref = reference(1)
    held = {}
    for opt in ("keep", "regather"):
        layer = build("column", True, ref, rank, world, delay_wgrad_compute=True, sp_wgrad_input=opt)
        held[opt] = run(layer, "column", True, ref, rank, world, "bundles", [0])["held"]
    item = torch.tensor([], dtype=F64).element_size()
    dy = S * B * (OUT // world) * item
    expected = {"keep": dy + S * B * IN * item, "regather": dy + S // world * B * IN * item}
    if held != expected:
        raise AssertionError(f"bytes held B->W {held}, expected {expected}")
    return held


def check_errors(rank: int, world: int) -> None:
    """Bad keywords and shapes are ValueErrors naming the layer and the values."""
    group = dist.group.WORLD
    cases = [
        (lambda: splitgrad.Linear(IN, OUT + 1, tp_group=group, parallel_mode="column"), "out_features=19"),
        (lambda: splitgrad.Linear(IN + 1, OUT, tp_group=group, parallel_mode="row"), "in_features=13"),
        (
            lambda: splitgrad.Linear(IN, OUT, tp_group=group, tp_size=world + 1, parallel_mode="row"),
            "tp_size",
        ),
        (lambda: splitgrad.Linear(IN, OUT, tp_group=group, sequence_parallel=True), "sequence_parallel"),
        (lambda: splitgrad.Linear(IN, OUT, tp_group=group, parallel_mode="diagonal"), "parallel_mode"),
    ]
    row = splitgrad.Linear(IN, OUT, tp_group=group, parallel_mode="row", sequence_parallel=True)
    cases.append((lambda: row(torch.randn(S + 1, B, IN // world)), "divisible"))
    cases.append((lambda: row(torch.randn(S, B, IN)), "in_features // tp_size"))
    for make, needle in cases:
        expect_error(ValueError, needle, make)


def check_groups(rank: int, world: int) -> None:
    """tensor_parallel_groups: adjacent TP ranks, outer groups across them; a non-divisor is refused."""
    from splitgrad.parallel.tensor import tensor_parallel_groups

    whole = tensor_parallel_groups(world)
    singles = tensor_parallel_groups(1)
    got = (whole.tp_rank, dist.get_world_size(whole.tp_group), whole.outer_rank, whole.outer_group)
    if got != (rank, world, 0, None):
        raise AssertionError(f"tp_size={world}: {got}")
    sizes = (
        dist.get_world_size(singles.tp_group),
        dist.get_world_size(singles.outer_group),
        singles.outer_rank,
    )
    if sizes != (1, world, rank):
        raise AssertionError(f"tp_size=1: {sizes}")
    try:
        tensor_parallel_groups(world + 1)
    except ValueError as exc:
        if "tp_size must divide" not in str(exc):
            raise
    else:
        raise AssertionError("no ValueError for a tp_size that does not divide the world")


def check_gpt_tp(rank: int, world: int) -> None:
    """GPT with tp_size = world (heads and MLP split) trains like tp_size=1: loss and every gradient shard."""
    from splitgrad.models import GPT, GPTConfig, lm_loss, shard_gpt_state_dict

    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 17, (2, 8), generator=gen)
    targets = torch.randint(0, 17, (2, 8), generator=gen)
    for act in ("gelu", "swiglu"):
        for delay in (False, True):
            common = dict(vocab_size=17, seq_len=8, hidden_size=24, num_heads=6, ffn_hidden_size=48,
                          activation=act, params_dtype=F64, delay_wgrad_compute=delay)  # fmt: skip
            torch.manual_seed(3)
            ref = GPT(GPTConfig(**common))
            tp = GPT(GPTConfig(**common, tp_size=world), tp_group=dist.group.WORLD)
            tp.load_state_dict(shard_gpt_state_dict(ref.state_dict(), tp.config, rank, world))
            losses = []
            for model in (ref, tp):
                loss = lm_loss(model(ids), targets)
                loss.backward()
                splitgrad.backward_dw(model)
                losses.append(loss.detach())
            what = f"GPT tp={world} {act} {delay=}"
            _close(f"{what} loss", losses[1], losses[0], TOL)
            expected = shard_gpt_state_dict(
                {n: p.grad for n, p in ref.named_parameters()}, tp.config, rank, world
            )
            for name, p in tp.named_parameters():
                _close(f"{what} {name}.grad", p.grad, expected[name], TOL)
    # Negative: the unsharded (rank 0's) qkv rows instead of this rank's heads give a different loss.
    torch.manual_seed(3)
    ref = GPT(GPTConfig(**common))
    tp = GPT(GPTConfig(**common, tp_size=world), tp_group=dist.group.WORLD)
    wrong = shard_gpt_state_dict(ref.state_dict(), tp.config, rank, world)
    for name in wrong:
        if ".attn.qkv.weight" in name:
            wrong[name] = ref.state_dict()[name][: wrong[name].shape[0]].clone()
    tp.load_state_dict(wrong)
    if torch.allclose(lm_loss(tp(ids), targets), lm_loss(ref(ids), targets), **TOL):
        raise AssertionError("GPT with naively sharded qkv rows matched the reference: the check cannot fail")


def run_checks(rank: int, world: int, names: list[str]) -> dict[str, object]:
    torch.manual_seed(0)
    from tests.tensor_parallel import tp_gpt_checks, tp_keyword_checks, tp_module_checks

    out: dict[str, object] = {}
    for name in names:
        try:
            fn = (
                globals().get(name)
                or getattr(tp_module_checks, name, None)
                or getattr(tp_keyword_checks, name, None)
                or getattr(tp_gpt_checks, name)
            )
            value = fn(rank, world)
            out[name] = None
            if value is not None:
                out[f"{name}:value"] = value
        except Exception:
            out[name] = traceback.format_exc()
    return out


ALL = [
    "check_groups",
    "check_linear_exactness",
    "check_wrong_answers_rejected",
    "check_sp_bytes_held",
    "check_errors",
    "check_gpt_tp",
]
