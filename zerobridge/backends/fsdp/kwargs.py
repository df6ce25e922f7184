"""Live torch objects built from the FSDP translators' JSON forms, for users who call torch FSDP themselves.

    >>> from torch import nn
    >>> from zerobridge.spec import ShardingSpec, SizeWrap, StrategySpec
    >>> from zerobridge.backends.fsdp.kwargs import fsdp2_units, to_fsdp2_kwargs
    >>> kwargs = to_fsdp2_kwargs(StrategySpec(sharding=ShardingSpec.for_stage(2)))
    >>> kwargs["reshard_after_forward"], type(kwargs["offload_policy"]).__name__
    (False, 'OffloadPolicy')
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    >>> fsdp2_units(StrategySpec(wrapping=SizeWrap(min_params=50)), model)
    [Linear(in_features=8, out_features=8, bias=True)]

``to_fsdp1_kwargs`` gives ``FullyShardedDataParallel(model, **kwargs)`` its
keywords from ``write_fsdp1(spec)``; ``to_fsdp2_kwargs`` gives
``fully_shard(module, **kwargs)`` its keywords from ``write_fsdp2(spec)``, and
``fsdp2_units`` the submodules to shard before the root. The translators in
``zerobridge/translate/`` stay torch-free data; everything that needs torch
(meshes, class lookup in a model, the process group's world size) is here.
The FSDP2 backend (``prepare.py``) builds its ``fully_shard`` keywords and
mesh with the same functions, and ``fsdp2_units`` cuts the same units it
does (``runtime/wrap_units.py``), so the backend and a script that calls
``fully_shard`` itself run the same thing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from zerobridge.backends.fsdp.apply import plan_units
from zerobridge.backends.fsdp.assess import with_world
from zerobridge.errors import ConfigError
from zerobridge.runtime.wrap_units import layer_class_names
from zerobridge.spec import StrategySpec, TransformerWrap
from zerobridge.translate.fsdp1 import CARRIED_FLAGS, HYBRID, MP_CARRIED, write_fsdp1
from zerobridge.translate.fsdp2 import write_fsdp2

__all__ = ["device_mesh_from_form", "fsdp2_units", "fully_shard_kwargs", "layer_classes", "to_fsdp1_kwargs",
           "to_fsdp2_kwargs", "with_world_size"]


def _device_type() -> str:
    """The device type meshes are built on when none is named."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def with_world_size(spec: StrategySpec, world_size: int | None) -> StrategySpec:
    """``spec`` with the world size of ``world_size`` or of the initialised process group."""
    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    return spec if world_size is None else with_world(spec, world_size)


def device_mesh_from_form(form: dict[str, Any] | None, *, world_size: int | None = None,
                         device_type: str | None = None) -> DeviceMesh | None:
    """The ``DeviceMesh`` a written form names (``{"shape", "mesh_dim_names"}``); no form: ``[world]``
    over ``dp_shard``. ``None`` when no process group is initialised. Built here, so that a hybrid
    run really replicates (dim 0 replicates, the last dim shards). The mesh's rank table is host
    bookkeeping read back as numbers, so it is built on real tensors even under a ``FakeTensorMode``
    (``zerobridge plan`` runs this backend on fake tensors: ``planning/fsdp_fake_run.py``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    shape = tuple(form["shape"]) if form is not None else (world_size or dist.get_world_size(),)
    names = tuple(form["mesh_dim_names"]) if form is not None else ("dp_shard",)
    with unset_fake_temporarily():
        return init_device_mesh(device_type or _device_type(), shape, mesh_dim_names=names)


def layer_classes(names: list[str] | str, module: nn.Module | None) -> set[type[nn.Module]]:
    """The classes named ``names`` (``"auto"``: ``module._no_split_modules``) in ``module``'s tree."""
    if module is None:
        raise ConfigError("layer classes are given by name: the model is needed to find them",
                          key="wrapping.layer_classes", fix="pass module=model")
    wanted = layer_class_names(module, TransformerWrap(layer_classes=names))  # type: ignore[arg-type]
    found = {type(m).__name__: type(m) for m in module.modules()}
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ConfigError(f"no module of class {', '.join(missing)} in the model", key="wrapping.layer_classes",
                          fix=f"use classes the model has: {', '.join(sorted(found))}")
    return {found[n] for n in wanted}


def to_fsdp1_kwargs(spec: StrategySpec, *, world_size: int | None = None,
                    module: nn.Module | None = None) -> dict[str, Any]:
    """Keyword arguments for ``FullyShardedDataParallel(model, **kwargs)``.

    Built from ``write_fsdp1(spec)``. ``device_mesh`` is built only when a
    process group is initialised (else omitted: FSDP1 then uses the default
    group). ``device_id`` is the CPU when CUDA is unavailable (FSDP1 needs it
    there), else the current CUDA device. Layer class names are resolved in
    ``module``. CPU offload on a host without CUDA is a ``ConfigError``
    (torch fails there). Left out: ``training_loop`` and ``state_dict_type`` (not
    constructor arguments; use ``FSDP.set_state_dict_type``), and the carried
    ``param_init_fn`` and ``ignored_modules``, which name Python objects.
    """
    spec = with_world_size(spec, world_size)
    form = write_fsdp1(spec).value
    cuda = torch.cuda.is_available()
    strategy, wrap = form["sharding_strategy"], form["auto_wrap_policy"]
    if strategy in HYBRID and form["device_mesh"] is None:
        if not cuda:
            raise ConfigError(f"{strategy} without a device_mesh shards inside each node, which on a CPU-only host "
                              "is one rank: every rank would train alone", key="sharding.shard_group",
                              fix="give sharding.shard_group as a number and pass world_size=")
        if wrap is None:
            raise ConfigError(f"FSDP1 rejects {strategy} with neither an auto_wrap_policy nor a device_mesh",
                              key="wrapping", fix="set a wrapping policy, or a numeric shard_group and world_size=")
    if form["cpu_offload"] and not cuda:
        raise ConfigError("FSDP1 cannot offload on a CPU-only host (it pins host memory through an accelerator)",
                          key="offload.parameters.device", fix="drop the offload here, or use FSDP2's CPUOffloadPolicy")
    kwargs: dict[str, Any] = {
        "sharding_strategy": ShardingStrategy[strategy],
        "cpu_offload": CPUOffload(offload_params=True) if form["cpu_offload"] else None,
        "backward_prefetch": TorchPrefetch[form["backward_prefetch"]] if form["backward_prefetch"] else None,
        "device_id": torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        **{k: form[k] for k in ("forward_prefetch", "limit_all_gathers", *CARRIED_FLAGS)},
    }
    mp = form["mixed_precision"]
    if mp is not None:
        param, reduce, buffer = (getattr(torch, mp[k]) if mp[k] else None
                                 for k in ("param_dtype", "reduce_dtype", "buffer_dtype"))
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=param, reduce_dtype=reduce, buffer_dtype=buffer,
                                                   **{k: mp[k] for k in MP_CARRIED})
    if wrap is not None and "min_num_params" in wrap:
        kwargs["auto_wrap_policy"] = functools.partial(size_based_auto_wrap_policy,
                                                       min_num_params=wrap["min_num_params"])
    elif wrap is not None:
        kwargs["auto_wrap_policy"] = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=layer_classes(wrap["transformer_layer_cls"], module))
    mesh = device_mesh_from_form(form["device_mesh"]) if form["device_mesh"] is not None else None
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    return kwargs


def fully_shard_kwargs(form: dict[str, Any], mesh: DeviceMesh | None, *, param_dtype: torch.dtype | None = None,
                       reduce_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``fully_shard``'s keywords from ``write_fsdp2``'s JSON form: ``mesh`` (left out when
    ``None``), ``reshard_after_forward``, ``mp_policy`` (dtypes as the form names them unless given:
    the backend passes the ones its run rules resolved), ``offload_policy`` (pinning only where an
    accelerator can pin host memory)."""
    mp = form["mp_policy"]
    dtypes = {k: getattr(torch, mp[k]) if mp[k] else None for k in ("param_dtype", "reduce_dtype", "output_dtype")}
    if param_dtype is not None:
        dtypes["param_dtype"] = param_dtype
    if reduce_dtype is not None:
        dtypes["reduce_dtype"] = reduce_dtype
    offload = form["offload_policy"]
    kwargs: dict[str, Any] = {
        "reshard_after_forward": form["reshard_after_forward"],
        "mp_policy": MixedPrecisionPolicy(**dtypes, cast_forward_inputs=mp["cast_forward_inputs"]),
        "offload_policy": OffloadPolicy() if offload is None else
        CPUOffloadPolicy(pin_memory=bool(offload["pin_memory"]) and torch.cuda.is_available()),
    }
    if mesh is not None:
        kwargs["mesh"] = mesh
    return kwargs


def to_fsdp2_kwargs(spec: StrategySpec, *, world_size: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``fully_shard(module, **kwargs)``, built from ``write_fsdp2(spec)``.

    ``mesh`` is built only when a process group is initialised and the form
    names one (else omitted: a 1-D mesh over the default group). Without
    CUDA, pinning is dropped (torch cannot pin host memory with no
    accelerator). ``wrap`` and ``training_loop`` are not ``fully_shard``
    arguments: use ``fsdp2_units`` for the first.
    """
    form = write_fsdp2(with_world_size(spec, world_size)).value
    return fully_shard_kwargs(form, device_mesh_from_form(form["mesh"]) if form["mesh"] is not None else None)


def fsdp2_units(spec: StrategySpec, module: nn.Module) -> list[nn.Module]:
    """The submodules to ``fully_shard`` before the root, innermost first: the spec's wrap units as
    every zerobridge engine cuts them (``runtime/wrap_units.py``), so a script calling
    ``fully_shard`` itself shards exactly what ``prepare(..., backend="fsdp")`` shards. A unit
    whose parameters all belong to an enclosing one (a tied weight) is left to it."""
    return plan_units(module, spec.wrapping).sharded
