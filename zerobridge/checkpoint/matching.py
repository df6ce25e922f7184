"""How a loader matches a checkpoint to a model and an optimizer, the same way on every backend.

    >>> import torch
    >>> from zerobridge.checkpoint.matching import state_to_param
    >>> param = torch.zeros(3, dtype=torch.bfloat16)
    >>> state_to_param("exp_avg", torch.ones(3), param, {}).dtype       # placed as Optimizer.load_state_dict does
    torch.bfloat16

Model tensors are found under any of a parameter's names (``check_model``:
shapes must agree; strictly, nothing may be missing or left over).
Optimizer state is found by parameter name (``state_keys``), param groups by
position (``group_keys``, ``restore_groups``), whatever wrote the checkpoint:
the native engine's runs, FSDP2's shards, DeepSpeed's partitions or a
portable file.
"""

from __future__ import annotations

from typing import Any

import torch

from zerobridge.checkpoint.layout import model_key, param_group_key
from zerobridge.checkpoint.reader import Checkpoint
from zerobridge.checkpoint.storage import CheckpointError

__all__ = ["check_model", "group_keys", "optimizer_params", "restore_groups", "state_keys", "state_to_param"]


def optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> set[int]:
    """``id()`` of every parameter ``optimizer`` holds; an error if one is not in ``names`` (the model's)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if held - set(names):
        raise CheckpointError(f"the optimizer holds {len(held - set(names))} parameter(s) the prepared model does "
                              "not own", key="optimizer",
                              fix="build the optimizer from model.parameters() after zerobridge.prepare")
    return held


def state_keys(ckpt: Checkpoint) -> dict[str, dict[str, str]]:
    """``{fqn: {state key: checkpoint key}}`` from the recorded paths (or the keys' last dot)."""
    found: dict[str, dict[str, str]] = {}
    for key in ckpt:
        path = ckpt.paths.get(key)
        if path is not None and len(path) == 4 and path[:2] == ("optim", "state"):
            found.setdefault(str(path[2]), {})[str(path[3])] = key
        elif path is None and key.startswith("optim.state."):
            fqn, _, state_key = key[len("optim.state."):].rpartition(".")
            found.setdefault(fqn, {})[state_key] = key
    return found


def group_keys(ckpt: Checkpoint) -> dict[int, dict[str, str]]:
    """``{group index: {hyperparameter: checkpoint key}}``."""
    found: dict[int, dict[str, str]] = {}
    for key in ckpt:
        path = ckpt.paths.get(key)
        parts = key.split(".", 3)
        if path is None and key.startswith("optim.param_groups.") and len(parts) == 4 and parts[2].isdigit():
            path = ("optim", "param_groups", int(parts[2]), parts[3])
        if path is not None and len(path) == 4 and path[:2] == ("optim", "param_groups") and isinstance(path[2], int):
            found.setdefault(path[2], {})[str(path[3])] = key
    return found


def restore_groups(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, names: dict[int, str],
                    frozen: set[str]) -> None:
    """Hyperparameters back into the optimizer's groups, matched by position; each group
    must hold the same trainable parameters (frozen ones never step, and some writers,
    DeepSpeed among them, leave them out of the groups)."""
    saved = group_keys(ckpt)
    if sorted(saved) != list(range(len(optimizer.param_groups))):
        raise CheckpointError(f"holds {len(saved)} optimizer param group(s); this optimizer has "
                              f"{len(optimizer.param_groups)}", source=ckpt.source, key="optim.param_groups",
                              fix="build the optimizer's param groups as the saving run did (or pass optimizer=None)")
    values = ckpt.read_bytes([key for group in saved.values() for key in group.values()])
    for i, group in enumerate(optimizer.param_groups):
        current = {names[id(p)] for p in group["params"]} - frozen
        if "params" in saved[i] and set(values[saved[i]["params"]]) - frozen != current:
            theirs = set(values[saved[i]["params"]]) - frozen
            raise CheckpointError(f"group {i} holds {sorted(theirs - current)[:3]} that this optimizer's group {i} "
                                  f"lacks, and lacks {sorted(current - theirs)[:3]}", source=ckpt.source,
                                  key=param_group_key(i, "params"),
                                  fix="put the same parameters in each group as the saving run did")
        for name, key in saved[i].items():
            if name != "params":
                group[name] = values[key]


def state_to_param(key: str, value: torch.Tensor, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Place a state tensor as torch's ``Optimizer.load_state_dict`` does."""
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point() and value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def check_model(ckpt: Checkpoint, params: list[tuple[tuple[str, ...], tuple[int, ...]]],
                buffers: dict[str, torch.Tensor], strict: bool) -> list[str | None]:
    """The checkpoint key of each parameter, given as (names, whole shape), or ``None`` where
    the checkpoint lacks it; a clear error for shape mismatches and, strictly, for missing or
    unexpected names. Shared by every backend's loader."""
    found: list[str | None] = []
    missing = []
    for names, shape in params:
        key = next((model_key(n) for n in names if ckpt.tensor(model_key(n)) is not None), None)
        found.append(key)
        if key is None:
            missing.append(names[0])
            continue
        saved = tuple(ckpt.tensor(key).size)  # type: ignore[union-attr]
        if saved != tuple(shape):
            raise CheckpointError(f"has shape {saved}; the model's parameter has {tuple(shape)}",
                                  source=ckpt.source, key=key, fix="load into the model architecture that saved it")
    for name, buffer in buffers.items():
        md = ckpt.tensor(model_key(name))
        if md is None:
            missing.append(name)
        elif tuple(md.size) != tuple(buffer.shape):
            raise CheckpointError(f"has shape {tuple(md.size)}; the model's buffer has {tuple(buffer.shape)}",
                                  source=ckpt.source, key=model_key(name),
                                  fix="load into the model architecture that saved it")
    known = {model_key(n) for names, _ in params for n in names} | {model_key(n) for n in buffers}
    unexpected = sorted(k for k in ckpt if k.startswith("model.") and k not in known)
    if strict and (missing or unexpected):
        parts = ([f"missing {len(missing)}: {', '.join(missing[:5])}"] if missing else []) + \
                ([f"unexpected {len(unexpected)}: {', '.join(unexpected[:5])}"] if unexpected else [])
        raise CheckpointError(f"does not match the model ({'; '.join(parts)})", source=ckpt.source, key="model",
                              fix="load into the model that saved it, or pass strict=False to load what matches")
    return found
