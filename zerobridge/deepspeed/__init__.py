"""DeepSpeed's entry points on every zerobridge backend: a DeepSpeed script switches by its import line.

    import zerobridge.deepspeed as deepspeed          # was: import deepspeed

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt", client_state={"epoch": 1})

The same script then runs on zerobridge's native engine, on torch FSDP2 or on
real DeepSpeed: ``ZEROBRIDGE_BACKEND=native|fsdp|deepspeed``, or
``zerobridge run --backend ...``. The config's ``optimizer`` and
``scheduler`` sections are built as torch objects whose numbers are
DeepSpeed's own (``zerobridge.runtime.optimizers``,
``zerobridge.runtime.lr_schedules``), once, for every backend; an
``optimizer=`` or ``lr_scheduler=`` passed in wins over the section, as in
DeepSpeed (with a warning that the section is not used). The config's ZeRO
settings become the spec ``zerobridge.prepare`` runs. docs/deepspeed-api.md
lists what is carried and what is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zerobridge.api import prepare
from zerobridge.deepspeed.config import RunConfig, read_config
from zerobridge.deepspeed.engine import REFUSED, DeepSpeedEngine
from zerobridge.distributed import init_distributed as start_group
from zerobridge.env import mark_prepared
from zerobridge.errors import ConfigError
from zerobridge.runtime.lr_schedules import build_scheduler
from zerobridge.runtime.optimizers import build_optimizer

__all__ = ["REFUSED", "DeepSpeedEngine", "init_distributed", "initialize"]

Params = Iterable[nn.Parameter] | Iterable[dict[str, Any]]


def init_distributed(dist_backend: str | None = None, *, dist_init_required: bool | None = None,
                     **_launcher: Any) -> None:
    """Start the default process group from the launcher's variables (torchrun, ``zerobridge run``, the
    ``deepspeed`` launcher), as DeepSpeed does: gloo on CPU, NCCL on GPUs unless ``dist_backend`` says.
    Leaves the random state alone (no module is built): a script's seed set before it holds after it."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if dist_backend is None:
        start_group(None, torch.device("cpu"))
        return
    dist.init_process_group(dist_backend)


def initialize(args: Any = None, model: nn.Module | None = None,
               optimizer: torch.optim.Optimizer | Callable[[Params], torch.optim.Optimizer] | None = None,
               model_parameters: Params | None = None, training_data: Dataset[Any] | None = None,
               lr_scheduler: LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: str | Path | dict[str, Any] | None = None,
               mesh_param: Any = None, config_params: str | Path | dict[str, Any] | None = None,
               ) -> tuple[DeepSpeedEngine, torch.optim.Optimizer | None, DataLoader[Any] | None, LRScheduler | None]:
    """``(engine, optimizer, training_dataloader, lr_scheduler)`` for ``model`` under ``config``, as
    ``deepspeed.initialize`` returns them, on the backend ``$ZEROBRIDGE_BACKEND`` names (native by default).

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is the config when ``config`` is not given.
        model: the model to train.
        optimizer: a torch optimizer, or a callable building one from ``model_parameters``; wins over the
            config's ``optimizer`` section.
        model_parameters: the parameters (or param groups) the optimizer steps; default ``model.parameters()``.
        training_data: a dataset: the returned loader gives each rank its micro-batches (DeepSpeed's sampler).
        lr_scheduler: a scheduler, or a callable building one from the optimizer; wins over the config's
            ``scheduler`` section.
        config: a DeepSpeed JSON/HJSON path or dict (``config_params`` is DeepSpeed's older name for it).
    """
    mark_prepared()
    if model is None:
        raise ConfigError("initialize() needs model=", key="model", fix="pass the model to train")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ConfigError(f"{name}= (model or sequence parallelism) is not carried by zerobridge.deepspeed",
                              key=name, fix="run data parallelism only, or keep `import deepspeed`")
    config = _config(args, config, config_params)
    init_distributed(dist_init_required=dist_init_required)
    run = read_config(config, world_size=dist.get_world_size())
    params: Params = model_parameters if model_parameters is not None else model.parameters()
    built = _optimizer(run, optimizer, params)
    prepared = prepare(model, built, config=run.spec) if built is not None else prepare(model, config=run.spec)
    module, stepped = prepared if isinstance(prepared, tuple) else (prepared, None)
    scheduler = _scheduler(run, lr_scheduler, stepped)
    loader = _loader(training_data, run, collate_fn) if training_data is not None else None
    return DeepSpeedEngine(module, stepped, scheduler, run), stepped, loader, scheduler


def _config(args: Any, config: str | Path | dict[str, Any] | None,
            config_params: str | Path | dict[str, Any] | None) -> str | Path | dict[str, Any]:
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    given = [c for c in (config, config_params, from_args) if c is not None]
    if len(given) > 1:
        raise ConfigError("the config is given twice (config=, config_params= or args.deepspeed_config): "
                          "DeepSpeed refuses that too", key="config", fix="pass it once")
    if not given:
        raise ConfigError("no DeepSpeed config: pass config= (a path or a dict) or args.deepspeed_config",
                          key="config", fix="initialize(model=model, config=\"ds_config.json\", ...)")
    return given[0]


def _optimizer(run: RunConfig, optimizer: Any, params: Params) -> torch.optim.Optimizer | None:
    if optimizer is not None:
        if run.optimizer is not None:
            warnings.warn(f"{run.source}: the optimizer section ({run.optimizer.get('type')}) is not used: "
                          "optimizer= was passed, and wins, as in DeepSpeed", stacklevel=3)
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(params)
    if run.optimizer is None:
        return None
    groups: list[Any] = list(params)  # parameters or param-group dicts
    return build_optimizer(run.optimizer, groups, offloaded=run.spec.offload.optimizer.enabled)


def _scheduler(run: RunConfig, scheduler: Any, optimizer: torch.optim.Optimizer | None) -> LRScheduler | None:
    if scheduler is not None:
        if run.scheduler is not None:
            warnings.warn(f"{run.source}: the scheduler section ({run.scheduler.get('type')}) is not used: "
                          "lr_scheduler= was passed, and wins, as in DeepSpeed", stacklevel=3)
        if isinstance(scheduler, LRScheduler):
            return scheduler
        if optimizer is None:
            raise ConfigError("lr_scheduler= is a callable but there is no optimizer to build it on",
                              key="lr_scheduler", fix="pass optimizer= or an optimizer section")
        return scheduler(optimizer)
    if run.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError(f"{run.source}: a scheduler section needs an optimizer", key="scheduler",
                          fix="add an optimizer section or pass optimizer=")
    return build_scheduler(run.scheduler, optimizer)


def _loader(data: Dataset[Any], run: RunConfig, collate_fn: Callable[..., Any] | None) -> DataLoader[Any]:
    """Each rank's micro-batches, with DeepSpeed's sampler (torch's ``DistributedSampler`` defaults)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world, rank=rank)
    return DataLoader(data, batch_size=run.micro_batch, sampler=sampler, collate_fn=collate_fn)
