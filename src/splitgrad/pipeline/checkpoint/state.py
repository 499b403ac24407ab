"""What a checkpoint holds, as one flat torch.distributed.checkpoint state dict keyed by global names.

* ``model.<name>``: every parameter and persistent buffer of the rank's stages (``<name>``: the whole model's,
  :mod:`.names`); replicas (data parallelism, dense parameters under expert parallelism) write the same key,
  and DCP keeps one copy.
* ``optim.state.<name>.<key>``: the optimizer's per-parameter state (AdamW: ``step``, ``exp_avg``,
  ``exp_avg_sq``), keyed by the parameter's global name rather than by its index in this rank's optimizer,
  which changes with the layout; ``optim.group.<name>``: the hyperparameters of its parameter group (``lr``,
  ``betas``, ...), so a learning-rate schedule's current value is restored too.
* ``rng.rank<r>.cpu`` (and ``rng.rank<r>.<device type>``): rank ``r``'s generator states, which differ per
  rank once dropout has drawn from them.
* ``step``; ``extra.<key>``: the job's own state (the data position, ...), the same on every rank.

DCP's ``get_state_dict`` / ``set_state_dict`` helpers were not used for the optimizer: they key its state by
the names of the module they are given, which on a pipeline rank is a stage (or several), under wrappers, with
local expert indices: names that change with the layout. Keying by the whole model's names here makes the
state load under any layout, and loading it through ``Optimizer.load_state_dict`` keeps every tensor as saved
(bitwise; AdamW's ``step`` stays a float32 tensor). Non-tensor values are pickled into ``uint8`` tensors, so
every entry is a tensor DCP reads into a buffer of the recorded size.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "apply_optimizer_state",
    "apply_rng_state",
    "decode",
    "encode",
    "optimizer_entries",
    "optimizer_keys",
    "rng_entries",
]

_STATE, _VALUE, _GROUP = "optim.state.", "optim.value.", "optim.group."


def encode(value: Any) -> torch.Tensor:
    """``value`` pickled into a 1-D ``uint8`` tensor (a non-tensor entry, as DCP stores tensors best)."""
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


def decode(tensor: torch.Tensor) -> Any:
    """Inverse of :func:`encode`. Only load checkpoints you trust: this unpickles (as ``torch.load`` of an
    optimizer's state dict would)."""
    return pickle.loads(bytes(tensor.tolist()))


def optimizer_entries(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, torch.Tensor]:
    """The optimizer's state and hyperparameters keyed by global parameter name.

    Args:
        optimizer: this rank's optimizer, over parameters of its stages only.
        names: ``id(parameter) -> global name`` of the rank's stage tensors.

    Raises:
        ValueError: the optimizer holds a parameter that is not one of the stages' tensors.
    """
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        hyper = encode({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            name = _name_of(p, names)
            out[f"{_GROUP}{name}"] = hyper
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{_STATE}{name}.{key}"] = value.detach()
                else:
                    out[f"{_VALUE}{name}.{key}"] = encode(value)
    return out


def _name_of(p: torch.Tensor, names: Mapping[int, str]) -> str:
    name = names.get(id(p))
    if name is None:
        raise ValueError(
            f"checkpoint: the optimizer holds a parameter {tuple(p.shape)} {p.dtype} that is not in this rank's "
            "stages; give the checkpointer the optimizer of the runtime's parameters"
        )
    return name


def optimizer_keys(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], saved: Iterable[str]
) -> list[str]:
    """The keys among ``saved`` (a checkpoint's) that belong to this optimizer's parameters."""
    mine = {_name_of(p, names) for group in optimizer.param_groups for p in group["params"]}
    out = []
    for key in saved:
        for prefix in (_STATE, _VALUE):
            if key.startswith(prefix):
                name, _, leaf = key[len(prefix) :].rpartition(".")
                if name in mine and leaf:
                    out.append(key)
        if key.startswith(_GROUP) and key[len(_GROUP) :] in mine:
            out.append(key)
    return out


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], loaded: Mapping[str, torch.Tensor]
) -> int:
    """Load what :func:`optimizer_entries` saved (read back into ``loaded``) into ``optimizer``.

    The optimizer's state becomes exactly the saved one (a parameter without saved state has none, as before
    its first step); each parameter group takes the hyperparameters saved with its parameters.

    Returns:
        How many parameters got state.

    Raises:
        ValueError: the parameters of one group were saved with different hyperparameters.
    """
    saved_state: dict[str, dict[str, Any]] = {}
    for key, value in loaded.items():
        for prefix in (_STATE, _VALUE):
            if key.startswith(prefix):
                name, _, leaf = key[len(prefix) :].rpartition(".")
                saved_state.setdefault(name, {})[leaf] = value if prefix == _STATE else decode(value)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        saved_hyper: torch.Tensor | None = None
        first = None
        for p in group["params"]:
            name = _name_of(p, names)
            if name in saved_state:
                state[index] = saved_state[name]
            hyper = loaded.get(f"{_GROUP}{name}")
            if hyper is not None:
                if saved_hyper is None:
                    saved_hyper, first = hyper, name
                elif not torch.equal(hyper, saved_hyper):
                    raise ValueError(
                        f"checkpoint: parameters {first!r} and {name!r} share a parameter group here but were "
                        f"saved with different hyperparameters ({decode(saved_hyper)} vs {decode(hyper)})"
                    )
            index += 1
        current = {k: v for k, v in group.items() if k != "params"}
        restored = {} if saved_hyper is None else decode(saved_hyper)
        params = list(range(index - len(group["params"]), index))
        groups.append({**current, **restored, "params": params})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return len(state)


def rng_entries(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generator states: the CPU one, and the accelerator's of ``device`` when it is one."""
    out = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        out[f"rng.rank{rank}.{device.type}"] = module.get_rng_state(device)
    return out


def apply_rng_state(rank: int, device: torch.device, loaded: Mapping[str, torch.Tensor]) -> None:
    """Set the generators :func:`rng_entries` saved for ``rank``."""
    torch.set_rng_state(loaded[f"rng.rank{rank}.cpu"])
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        module.set_rng_state(loaded[f"rng.rank{rank}.{device.type}"], device)
