"""The public API: prepare a model, clip, read full state, measure, save and load.

    >>> import torch, zerobridge
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> model = zerobridge.prepare(model, stage=3)         # world size 1 under plain python
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> model(torch.randn(4, 8)).pow(2).mean().backward()
    >>> norm = zerobridge.clip_grad_norm_(model, 1.0)
    >>> optimizer.step(); optimizer.zero_grad()
    >>> sorted(zerobridge.full_state_dict(model))
    ['0.bias', '0.weight', '2.bias', '2.weight']
    >>> zerobridge.spec_of(model).summary()
    'stage 3, params reshard_after_forward, compute fp32'

Launch on several ranks with ``zerobridge run --nproc 4 --stage 3 train.py``
or plain ``torchrun``. With no strategy argument, ``ZEROBRIDGE_CONFIG`` in the
environment chooses one; with neither, stage 0 (plain data parallel).

This module is a facade: ``prepare`` resolves the arguments (spec, backend,
compile, a meta-device model) and hands the model to the chosen backend's
``prepare`` (``backends/<name>/prepare.py``); every other call asks the
model's backend (``backend_of``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn

from zerobridge.backends.base import backend_of, check_fresh
from zerobridge.backends.native.prepare import prepare as prepare_native
from zerobridge.checkpoint.run_state import Stateful, resumed, run_state
from zerobridge.checkpoint.storage import CheckpointError, latest_checkpoint
from zerobridge.distributed import init_distributed
from zerobridge.env import choice_from_env, mark_prepared, resolve_allow_approximate, resolve_backend, resolve_compile
from zerobridge.errors import ConfigError
from zerobridge.load import load_spec
from zerobridge.pretrained.load import LoadReport, write_weights
from zerobridge.runtime.compile import check_compile, is_compiled_wrapper, unwrap_compiled
from zerobridge.runtime.deferred_init import Replay, is_meta_model, materialize_device
from zerobridge.spec import StrategySpec
from zerobridge.spec.presets import spec_for_stage
from zerobridge.translate.carried import SECTIONS

__all__ = ["clip_grad_norm_", "full_state_dict", "init_distributed", "is_accumulation_boundary", "latest_checkpoint",
           "load_checkpoint", "load_pretrained", "prepare", "reset_stats", "resolve_spec", "save_checkpoint",
           "save_full", "spec_for_stage", "spec_of", "stats"]

InitFn = Callable[[nn.Module], object]
Prepared = nn.Module | tuple[nn.Module, torch.optim.Optimizer]



def _backend_prepare(name: str) -> Callable[..., Prepared]:
    """The ``prepare(model, optimizer, spec, *, allow_approximate, replay, device)`` of backend ``name``.
    FSDP2 and DeepSpeed load torch's DTensor, FSDP and checkpoint stacks (about 2 s per process), so a
    run on the native engine never imports them."""
    if name == "fsdp":
        from zerobridge.backends.fsdp.prepare import prepare as prepare_fsdp  # lazy: loads torch.distributed.fsdp

        return prepare_fsdp
    if name == "deepspeed":
        from zerobridge.backends.deepspeed.prepare import (
            prepare as prepare_deepspeed,  # lazy: loads torch.distributed.checkpoint (deepspeed itself when run)
        )

        return prepare_deepspeed
    return prepare_native


def resolve_spec(model: nn.Module, *, stage: int | None, strategy: str | None,
                 config: str | Path | dict[str, Any] | StrategySpec | None) -> StrategySpec:
    """The spec the arguments (or ``ZEROBRIDGE_CONFIG``) name."""
    given = [name for name, value in (("stage", stage), ("strategy", strategy), ("config", config))
             if value is not None]
    if len(given) > 1:
        raise ConfigError(f"prepare() got {' and '.join(given)}: name the strategy once",
                          key=given[1], fix=f"pass only {given[0]}=")
    if stage is not None:
        return spec_for_stage(stage, model)
    if strategy is not None:
        return load_spec(strategy).value
    if config is not None:
        return load_spec(config).value
    chosen = choice_from_env()
    if chosen is None:
        return spec_for_stage(0, model)
    kind, choice = chosen
    if kind == "stage":
        return spec_for_stage(int(choice), model)
    return load_spec(str(choice)).value


_WARNED: set[str] = set()


def _warn_sections(spec: StrategySpec) -> None:
    """Once per process and kind: prepare() steps the user's optimizer and scheduler, not the config's sections."""
    found = tuple(s for s in SECTIONS if s in spec.passthrough.get("deepspeed", {}) and s not in _WARNED)
    if found:
        _WARNED.update(found)
        warnings.warn(f"the config's {' and '.join(found)} section{'s are' if len(found) > 1 else ' is'} not "
                      "applied by zerobridge.prepare, which steps your own optimizer (and scheduler) on every backend; "
                      "to build them from the config as DeepSpeed does, use `import zerobridge.deepspeed as "
                      "deepspeed` and `deepspeed.initialize(...)`", stacklevel=3)


def _check_model(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    check_fresh(model, optimizer)  # before anything else looks at the model (each backend checks it too)
    params = list(model.parameters())
    if not params:
        raise ConfigError(f"{type(model).__name__} has no parameters to shard", key="model",
                          fix="pass the module that owns the parameters")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ConfigError(f"parameters on several devices: {sorted(map(str, devices))}", key="model",
                          fix="move the model to one device before prepare (model.to(device))")


@overload
def prepare(model: nn.Module, optimizer: None = None, *, stage: int | None = None, strategy: str | None = None,
            config: str | Path | dict[str, Any] | StrategySpec | None = None, backend: str | None = None,
            allow_approximate: bool | None = None, init_fn: InitFn | None = None,
            device: torch.device | str | None = None, compile: bool | None = None) -> nn.Module: ...
@overload
def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int | None = None,
            strategy: str | None = None, config: str | Path | dict[str, Any] | StrategySpec | None = None,
            backend: str | None = None, allow_approximate: bool | None = None, init_fn: InitFn | None = None,
            device: torch.device | str | None = None, compile: bool | None = None
            ) -> tuple[nn.Module, torch.optim.Optimizer]: ...


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, stage: int | None = None,
            strategy: str | None = None, config: str | Path | dict[str, Any] | StrategySpec | None = None,
            backend: str | None = None, allow_approximate: bool | None = None, init_fn: InitFn | None = None,
            device: torch.device | str | None = None, compile: bool | None = None
            ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Shard ``model`` (in place) as the strategy says; return it, or ``(model, optimizer)``.

    Args:
        model: the model to shard, built eagerly or on the meta device (or what
            ``torch.compile`` returned).
        optimizer: built on the original parameters, not stepped yet.
        stage, strategy, config: the strategy, named once (a ZeRO stage, a registry
            name, or a config file / dict / spec); none: ``$ZEROBRIDGE_CONFIG``, else stage 0.
        backend: ``"native"``, ``"fsdp"`` or ``"deepspeed"``; ``None``: ``$ZEROBRIDGE_BACKEND``.
        allow_approximate: run a backend's closest form of what it cannot express exactly.
        init_fn: a meta model's initializer, called on every module.
        device: where a meta model materializes.
        compile: compile the units (``None``: ``$ZEROBRIDGE_COMPILE``, else the spec).

    ``optimizer``: one built before on the original parameters; its param
    groups and hyperparameters are kept, its parameters replaced by the
    sharded ones. It must not have stepped yet.

    ``backend``: ``"native"`` (zerobridge's engine), ``"fsdp"`` (torch
    FSDP2) or ``"deepspeed"``; ``None``: ``$ZEROBRIDGE_BACKEND``, else
    native. ``allow_approximate``: run what a backend cannot express exactly
    as its closest equivalent (recorded) instead of refusing; ``None``:
    ``$ZEROBRIDGE_ALLOW_APPROXIMATE`` (``zerobridge run --allow-approximate``), else False.

    A model built under ``torch.device("meta")`` is materialized here, one
    module at a time, with the values an eager build from the same seed would
    have had (docs/big-models.md). ``init_fn(module)``: called on every module,
    children first, instead of its own ``reset_parameters()`` /
    ``_init_weights``. ``device``: where a meta model materializes (default:
    ``cuda:$LOCAL_RANK`` when CUDA is available, else the CPU).

    ``compile``: run the model's units under ``torch.compile`` as the spec's
    ``compile`` section says (``True``/``False`` override its ``enabled``;
    ``None``: ``$ZEROBRIDGE_COMPILE``, set by ``zerobridge run --compile``,
    else the spec). A model ``torch.compile`` returned may be passed too: the
    module inside is sharded and the compiled wrapper returned (docs/compile.md).

    Under ``zerobridge run``, the first thing it does is tell the launcher it was called
    (``env.mark_prepared``): a script that never calls it is warned about.
    """
    mark_prepared()
    chosen = resolve_backend(backend)
    approximate = resolve_allow_approximate(allow_approximate)
    compiling = resolve_compile(compile)
    wrapper, model = model, unwrap_compiled(model)
    meta = is_meta_model(model)  # first: a partly-meta model is named as such
    _check_model(model, optimizer)
    replay = Replay(model, init_fn) if meta else None
    if replay is None and init_fn is not None:
        raise ConfigError("init_fn is given but the model is not on the meta device", key="init_fn",
                          fix="build the model under `with torch.device('meta'):`, or initialize it yourself")
    target = materialize_device(device) if replay is not None else None
    spec = _with_compile(resolve_spec(model, stage=stage, strategy=strategy, config=config), compiling,
                         wrapped=wrapper is not model)
    _warn_sections(spec)
    prepared = _backend_prepare(chosen)(model, optimizer, spec, allow_approximate=approximate, replay=replay,
                                        device=target)
    return _rewrap(prepared, wrapper)


def _with_compile(spec: StrategySpec, compiling: bool | None, *, wrapped: bool) -> StrategySpec:
    """The spec with ``compile.enabled`` as the caller decided; a model compiled before
    ``prepare`` is not compiled again."""
    if compiling is not None and compiling != spec.compile.enabled:
        spec = spec.model_copy(update={"compile": spec.compile.model_copy(update={"enabled": compiling})})
    if wrapped and spec.compile.enabled:
        raise ConfigError("the model was compiled before prepare (torch.compile returned it) and the spec "
                          "compiles it again", key="compile.enabled",
                          fix="compile once: pass the uncompiled model, or prepare(..., compile=False)")
    check_compile(spec.compile)
    return spec


def _rewrap(prepared: nn.Module | tuple[nn.Module, torch.optim.Optimizer], wrapper: nn.Module
            ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """What a backend prepared (in place), returned through the user's compiled wrapper
    if there was one."""
    if not is_compiled_wrapper(wrapper):
        return prepared
    return (wrapper, prepared[1]) if isinstance(prepared, tuple) else wrapper


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm over every rank and shard; return the norm before clipping.

    Args:
        model: a prepared model, after backward at an accumulation boundary.
        max_norm: the largest global norm left after clipping (``inf``: measure only).
        norm_type: the p of the p-norm (``inf`` for the max-norm; DeepSpeed computes the 2-norm only).
    """
    return backend_of(model).clip_grad_norm(float(max_norm), float(norm_type))


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False
                    ) -> dict[str, torch.Tensor]:
    """The unsharded state dict under the original names (tied ones under each). Collective.

    With both flags, the native engine gathers one group at a time to rank 0's
    host memory: no rank holds the whole model on its device.

    Args:
        model: a prepared model.
        rank0_only: only rank 0 gets the values (the others ``{}``).
        offload_to_cpu: the values in host memory.
    """
    return backend_of(model).full_state(rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)


def stats(model: nn.Module) -> dict[str, Any]:
    """This rank's model-state bytes and communication since the last reset.

    ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (master plus optimizer
    state): bytes in memory. ``tier_bytes``: all of them by where they live,
    ``device`` (tier none, also on a CPU machine), ``host`` (tier cpu, and the
    small state kept in memory by the nvme tier) and ``nvme`` (swap files).
    ``comm_bytes`` / ``comm_calls``: per collective kind since the last
    ``reset_stats``. ``loss_scale``, ``skipped_steps``: fp16 loss scaling.
    ``approximations`` (FSDP2, DeepSpeed): what the backend runs differently
    from the spec.

    Args:
        model: a prepared model.
    """
    return backend_of(model).stats()


def spec_of(model: nn.Module) -> StrategySpec:
    """The spec a prepared ``model`` runs, on any backend: what ``prepare`` resolved from its
    arguments or ``$ZEROBRIDGE_CONFIG`` (``spec_of(model).summary()`` says it in one line). What the
    backend runs differently from it is listed in ``stats(model)["approximations"]``.

    Args:
        model: a prepared model.
    """
    return backend_of(model).spec


def is_accumulation_boundary(model: nn.Module) -> bool:
    """Whether the last ``loss.backward()`` closed the accumulation window of a prepared ``model``, on any
    backend: the gradients are whole and ``optimizer.step()`` steps on them (between boundaries it is a no-op),
    so step a learning-rate scheduler only then. Before the first backward of a window: whether the next one
    will close it.

        loss.backward()
        if zerobridge.is_accumulation_boundary(model):
            optimizer.step()
            scheduler.step()        # once per optimizer step, not per micro-batch
            optimizer.zero_grad()

    Args:
        model: a prepared model.
    """
    return backend_of(model).window.at_boundary


def reset_stats(model: nn.Module) -> None:
    """Start counting communication from zero.

    Args:
        model: a prepared model.
    """
    backend_of(model).reset_stats()


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    scheduler: Stateful | None = None, client_state: dict[str, Any] | None = None,
                    metadata: dict[str, Any] | None = None) -> Path:
    """Write a sharded checkpoint of a prepared ``model`` (and ``optimizer``, ``scheduler``) at ``path``. Collective.

    Each rank writes its own runs (first replica only) in
    ``torch.distributed.checkpoint`` format with FSDP2's keys; master values
    (fp32 under mixed precision), optimizer state and param groups, the loss
    scaler, skipped steps and every rank's RNG states. Rank 0 adds the
    scheduler's ``state_dict()``, ``client_state`` and ``metadata``, all
    inside the same atomic save. Call it after ``optimizer.step()`` and
    ``scheduler.step()``: gradients are not saved. The previous checkpoint at
    ``path`` stays until the new one is complete.

    Args:
        path: the checkpoint directory (created; replaced atomically when it exists).
        model: a prepared model.
        optimizer: the optimizer stepping it (``None``: the model only).
        scheduler: its LR scheduler (any torch ``LRScheduler``, or an object with
            ``state_dict()`` / ``load_state_dict()``), restored by ``load_checkpoint(scheduler=...)``.
        client_state: a dict of plain values (numbers, strings, lists, tuples, dicts, tensors:
            what ``torch.load(weights_only=True)`` reads back), as DeepSpeed's
            ``save_checkpoint(client_state=...)``; ``load_checkpoint`` returns it under ``"client_state"``.
            Rank 0's is saved.
        metadata: JSON-able values returned by ``load_checkpoint``.
    """
    run = run_state(metadata, scheduler, client_state)
    return backend_of(model).save_checkpoint(Path(path), optimizer, run)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    scheduler: Stateful | None = None, strict: bool = True, rng: bool = True,
                    verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint into a prepared ``model`` (and ``optimizer``, ``scheduler``), resharding
    to this run's stage, world size and layout. Collective. Returns the
    ``metadata`` passed to ``save_checkpoint`` (``{}`` if none), plus
    ``"client_state"``: the saved ``client_state``, when one was saved.

    Files are checked against the manifest first (each rank a share);
    ``strict``: every parameter and buffer must be in the checkpoint and it
    may hold no others, with an ``optimizer`` the checkpoint must hold
    optimizer state, and with a ``scheduler`` scheduler state (else it is
    skipped). Param groups are matched by position (same parameter names in
    each), state by parameter name; the scheduler is restored after them, so
    its next ``step()`` continues the saved schedule (a DeepSpeed schedule's
    ``{"last_batch_iteration": n}`` loads into a torch ``LRScheduler`` and
    the other way round). ``rng``: restore RNG states, rank ``r`` taking
    saved rank ``r mod saved world size``. Checkpoints written by
    ``torch.distributed.checkpoint`` (FSDP2) load too, unverified (they have
    no manifest), with a warning; a zerobridge checkpoint whose
    ``zerobridge.json`` was lost is refused unless ``verify=False``; a DeepSpeed
    checkpoint directory is refused with the ``zerobridge checkpoint
    import-deepspeed`` command that converts it. Any file that cannot be read
    is named in the error.

    Args:
        path: a checkpoint directory written at any stage, world size, layout or backend.
        model: a prepared model.
        optimizer: the optimizer to restore (``None``: the model only).
        scheduler: the LR scheduler to restore (``None``: left as it is).
        strict: every name must match both ways, and optimizer and scheduler state must be there.
        rng: restore the random generators.
        verify: check every file's size and sha256 against ``zerobridge.json`` before reading, and refuse
            a zerobridge checkpoint without one; ``False`` reads unchecked.
    """
    run = backend_of(model).load_checkpoint(Path(path), optimizer, strict=strict, rng=rng,
                                            with_scheduler=scheduler is not None, verify=verify)
    return resumed(run, scheduler)


def save_full(path: str | Path, model: nn.Module, *, dtype: torch.dtype | None = None) -> Path:
    """Write the whole model's weights (``zerobridge.full_state_dict``) as one
    safetensors file, floating tensors cast to ``dtype`` if given. Collective:
    the values are gathered group by group into rank 0's host memory, and rank
    0 writes (atomically).

    Args:
        path: the ``.safetensors`` file to write.
        model: a prepared model.
        dtype: the dtype floating tensors are written in (default: as held).
    """
    from zerobridge.checkpoint.full import write_safetensors  # lazy: loads torch.distributed.checkpoint
    from zerobridge.checkpoint.writer import agree  # lazy: loads torch.distributed.checkpoint

    whole = full_state_dict(model, rank0_only=True, offload_to_cpu=True)  # one group at a time, to rank 0's host
    state = {k: v for k, v in whole.items() if isinstance(v, torch.Tensor)}
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    error: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            write_safetensors(path, state, dtype=dtype)
        except (OSError, CheckpointError) as exc:
            error = exc
    agree(distributed, error)
    return Path(path)


def load_pretrained(model: nn.Module, source: str | Path, *, strict: bool = True) -> LoadReport:
    """Write the weights in ``source`` into a prepared ``model``; each rank reads only the runs it
    holds, cast to the master dtype. Collective. Returns the report.

    Args:
        model: a prepared model (native engine or FSDP2 backend).
        source: a safetensors file, a Hugging Face model directory (one file or shards with an
            index), a ``.bin`` / ``.pt`` state dict, or a checkpoint directory (resharded by
            ``load_checkpoint``).
        strict: every parameter must be found and nothing left over; ``False`` reports instead.
    """
    backend = backend_of(model)
    path = Path(source)
    if path.is_dir() and (path / ".metadata").is_file():
        load_checkpoint(path, model, strict=strict, rng=False)
        return LoadReport(source=str(path), loaded=len(model.state_dict()))
    report = write_weights(model, path, backend.pretrained_targets(), strict=strict)
    backend.after_pretrained()
    return report
