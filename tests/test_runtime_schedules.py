"""A DeepSpeed JSON's optimizer and scheduler, built as torch objects, against DeepSpeed's own (no process group).

Schedules: ours and DeepSpeed's class (``deepspeed.runtime.lr_schedules``) on identical torch optimizers, read after
construction and after each of 200 steps: lr of every param group (and betas, where OneCycle cycles them) equal to
1e-12 relative. A state_dict saved midway (through ``torch.save`` / ``torch.load(weights_only=True)``) resumes
identically, and so does DeepSpeed's own ``{"last_batch_iteration": n}``.

Optimizers: DeepSpeed's side is its engine's ``_configure_basic_optimizer`` on a stand-in engine, so its own
selection builds it: torch classes, and FusedAdam, DeepSpeedCPUAdam and DeepSpeedCPUAdagrad through their C++ ops
when ``$TORCH_EXTENSIONS_DIR`` already holds them (built once by ``make test`` or DeepSpeed; these cases skip
otherwise, as compiling takes minutes). Five steps on identical params and gradients: params equal to 1e-6 (torch
classes: bitwise). Without the ops, Adam's update is still checked against DeepSpeed's kernel formula written out
in float64 (``_kernel_adam``).

The last tests break one rule at a time (the one-step lag, Adam's weight-decay default, OneCycle's beta2) and
check that the comparisons here catch it.
"""

from __future__ import annotations

import functools
import io
import os
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from zerobridge.errors import ConfigError
from zerobridge.runtime import optimizers
from zerobridge.runtime.lr_schedules import OneCycle, WarmupLR, build_scheduler
from zerobridge.runtime.optimizers import OWN_OPTIMIZER, build_optimizer, resolve_optimizer

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

STEPS = 200
REL = 1e-12


@pytest.fixture(scope="module")
def ds() -> types.SimpleNamespace:
    """DeepSpeed's schedules and engine (the tests that need them skip without DeepSpeed)."""
    schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    engine = pytest.importorskip("deepspeed.runtime.engine")
    config = pytest.importorskip("deepspeed.runtime.config")
    return types.SimpleNamespace(schedules=schedules, Engine=engine.DeepSpeedEngine, OWN=config.DEEPSPEED_OPTIMIZERS)


@pytest.fixture(scope="module", autouse=True)
def _cpu_info_once() -> Iterator[None]:
    """DeepSpeedCPUAdam asks py-cpuinfo for the CPU's vendor each time it is built (subprocesses, about 1.5 s):
    ask once."""
    try:
        import cpuinfo
    except ImportError:
        yield
        return
    patch = pytest.MonkeyPatch()
    patch.setattr(cpuinfo, "get_cpu_info", functools.cache(cpuinfo.get_cpu_info))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DeepSpeed's and our warnings on odd configs
        yield


# ----------------------------------------------------------------------------- schedules


def _adamw() -> torch.optim.Optimizer:
    """Two param groups with their own lr: per-group rules show."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    return torch.optim.AdamW([{"params": a.parameters()}, {"params": b.parameters(), "lr": 3e-3}], lr=1e-3,
                             betas=(0.85, 0.995))


def _sgd() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    return torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.05, momentum=0.9)


Reading = list[tuple[float, tuple[float, ...], float]]


def _read(optimizer: torch.optim.Optimizer) -> Reading:
    """(lr, betas, momentum) of each param group."""
    return [(float(g["lr"]), tuple(float(b) for b in g.get("betas", ())), float(g.get("momentum", 0.0)))
            for g in optimizer.param_groups]


def _trace(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int = STEPS) -> list[Reading]:
    """The readings after construction and after each step, stepped as an engine steps them."""
    out = [_read(optimizer)]
    for _ in range(steps):
        optimizer.step()  # no gradients: nothing moves, but torch sees the order it expects
        scheduler.step()
        out.append(_read(optimizer))
    return out


def _assert_same(ours: list[Reading], theirs: list[Reading]) -> None:
    assert len(ours) == len(theirs)
    for step, (mine, other) in enumerate(zip(ours, theirs)):
        for group, ((lr, betas, mom), (lr2, betas2, mom2)) in enumerate(zip(mine, other)):
            where = f"after {step} steps, group {group}"
            assert lr == pytest.approx(lr2, rel=REL, abs=0), f"lr {where}: {lr} != {lr2}"
            assert betas == pytest.approx(betas2, rel=REL, abs=0), f"betas {where}: {betas} != {betas2}"
            assert mom == mom2, f"momentum {where}"


SCHEDULES: dict[str, tuple[dict[str, Any], Callable[[], torch.optim.Optimizer]]] = {
    "warmup-defaults": ({"type": "WarmupLR"}, _adamw),
    "warmup-log": ({"type": "WarmupLR", "params": {"warmup_num_steps": 50}}, _adamw),
    "warmup-linear": ({"type": "WarmupLR", "params": {"warmup_num_steps": 50, "warmup_type": "linear"}}, _adamw),
    "warmup-min-max": ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 37}}, _adamw),
    "warmup-one-step": ({"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_type": "linear"}}, _adamw),
    "warmup-per-group": ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 1e-4], "warmup_max_lr": [1e-3, 2e-3],
                                                         "warmup_num_steps": 20}}, _adamw),
    "warmup-unknown-type": ({"type": "WarmupLR", "params": {"warmup_num_steps": 30, "warmup_type": "cosine"}},
                            _adamw),
    "warmup-resumed": ({"type": "WarmupLR", "params": {"warmup_num_steps": 50, "last_batch_iteration": 10}},
                       _adamw),
    "decay-defaults": ({"type": "WarmupDecayLR", "params": {"total_num_steps": 150}}, _adamw),
    "decay-linear-min": ({"type": "WarmupDecayLR", "params": {"total_num_steps": 120, "warmup_num_steps": 30,
                                                              "warmup_min_lr": 1e-5, "warmup_type": "linear"}},
                         _adamw),
    "decay-log-max": ({"type": "WarmupDecayLR", "params": {"total_num_steps": 180, "warmup_num_steps": 25,
                                                           "warmup_max_lr": 5e-3}}, _sgd),
    "decay-peak-null": ({"type": "WarmupDecayLR", "params": {"total_num_steps": 90, "warmup_max_lr": None,
                                                             "warmup_num_steps": 10}}, _adamw),
    "decay-short": ({"type": "WarmupDecayLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}, _adamw),
    "cosine-defaults": ({"type": "WarmupCosineLR", "params": {"total_num_steps": 150}}, _adamw),
    "cosine-linear-ratios": ({"type": "WarmupCosineLR", "params": {
        "total_num_steps": 180, "warmup_num_steps": 20, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05,
        "warmup_type": "linear"}}, _adamw),
    "cosine-log-zero-floor": ({"type": "WarmupCosineLR", "params": {
        "total_num_steps": 120, "warmup_num_steps": 15, "warmup_min_ratio": 0.02, "cos_min_ratio": 0.0}}, _sgd),
    "cosine-no-decay-window": ({"type": "WarmupCosineLR", "params": {"total_num_steps": 40,
                                                                     "warmup_num_steps": 40}}, _adamw),
    "onecycle-momentum": ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                          "cycle_first_step_size": 40}}, _adamw),
    "onecycle-asymmetric-stairs": ({"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 2e-3, "cycle_first_step_size": 30, "cycle_second_step_size": 50,
        "cycle_first_stair_count": 4, "cycle_second_stair_count": 3}}, _adamw),
    "onecycle-stairs-decay": ({"type": "OneCycle", "params": {
        "cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": [1e-3, 3e-3], "cycle_first_step_size": 25,
        "cycle_first_stair_count": 5, "decay_step_size": 10, "decay_lr_rate": 0.1, "decay_mom_rate": 0.05,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}, _adamw),
    "onecycle-lr-decay-only": ({"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 20, "cycle_second_step_size": 0,
        "decay_step_size": 7, "decay_lr_rate": 0.3}}, _adamw),
    "onecycle-no-momentum": ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                             "cycle_first_step_size": 40, "cycle_momentum": False}},
                             _adamw),
    "onecycle-sgd": ({"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                     "cycle_first_step_size": 30}}, _sgd),
    "onecycle-resumed": ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                         "cycle_first_step_size": 40, "last_batch_iteration": 55}},
                         _adamw),
    "range-defaults": ({"type": "LRRangeTest"}, _adamw),
    "range-continuous": ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": [1e-4, 1e-3],
                                                            "lr_range_test_step_size": 7,
                                                            "lr_range_test_step_rate": 0.5}}, _adamw),
    "range-staircase": ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-3,
                                                           "lr_range_test_step_size": 10,
                                                           "lr_range_test_step_rate": 2.0,
                                                           "lr_range_test_staircase": True}}, _sgd),
}


def _theirs(ds: types.SimpleNamespace, section: dict[str, Any], optimizer: torch.optim.Optimizer) -> Any:
    """DeepSpeed's scheduler for ``section``, as its engine builds it."""
    return getattr(ds.schedules, section["type"])(optimizer, **section.get("params", {}))


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_schedule_equals_deepspeeds_at_every_step(case: str, ds: types.SimpleNamespace) -> None:
    section, make = SCHEDULES[case]
    ours_opt, theirs_opt = make(), make()
    ours = build_scheduler(section, ours_opt)
    assert isinstance(ours, torch.optim.lr_scheduler.LRScheduler)
    _assert_same(_trace(ours_opt, ours), _trace(theirs_opt, _theirs(ds, section, theirs_opt)))


@pytest.mark.parametrize("case", ["warmup-log", "decay-linear-min", "cosine-linear-ratios", "onecycle-stairs-decay",
                                  "range-staircase"])
def test_state_dict_resumes_midway(case: str, ds: types.SimpleNamespace) -> None:
    """Saved after 70 steps and loaded into a fresh optimizer and scheduler, it goes on as the original does; a
    DeepSpeed scheduler's state resumes it on DeepSpeed's schedule."""
    section, make = SCHEDULES[case]
    optimizer = make()
    scheduler = build_scheduler(section, optimizer)
    _trace(optimizer, scheduler, 70)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain data: no callables, no classes of ours
    assert saved["scheduler"]["last_batch_iteration"] == 69

    resumed_opt = make()
    resumed = build_scheduler(section, resumed_opt)
    resumed_opt.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["scheduler"])
    _assert_same(_trace(resumed_opt, resumed, 80), _trace(optimizer, scheduler, 80))

    their_opt = make()
    theirs = _theirs(ds, section, their_opt)
    _trace(their_opt, theirs, 70)
    from_deepspeed_opt = make()
    from_deepspeed = build_scheduler(section, from_deepspeed_opt)
    from_deepspeed_opt.load_state_dict(their_opt.state_dict())
    from_deepspeed.load_state_dict(theirs.state_dict())
    _assert_same(_trace(from_deepspeed_opt, from_deepspeed, 80), _trace(their_opt, theirs, 80))


def test_torch_scheduler_by_name_is_torchs() -> None:
    a, b = _sgd(), _sgd()
    ours = build_scheduler({"type": "StepLR", "params": {"step_size": 7, "gamma": 0.5}}, a)
    assert type(ours) is torch.optim.lr_scheduler.StepLR
    _assert_same(_trace(a, ours, 30), _trace(b, torch.optim.lr_scheduler.StepLR(b, step_size=7, gamma=0.5), 30))


SCHEDULE_REFUSALS: list[tuple[dict[str, Any], str, str, bool]] = [
    # (section, key, a piece of the fix, whether DeepSpeed refuses it too)
    ({"type": "WarmupLr"}, "scheduler.type", "write 'WarmupLR'", True),
    ({"type": "CosineWarmup"}, "scheduler.type", "write", True),
    ({"type": "WarmupLR", "params": {"warmup_steps": 10}}, "scheduler.params.warmup_steps",
     "rename it 'warmup_num_steps'", True),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, "scheduler.params.total_num_steps",
     "set scheduler.params.total_num_steps", True),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}, "scheduler.params.cycle_min_lr", "set", True),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}, "scheduler.params.warmup_max_lr",
     "write the value", False),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}, "scheduler.params.total_num_steps",
     "write the value", False),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "scheduler.params.warmup_num_steps",
     "positive integer", True),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2.5}},
     "scheduler.params.warmup_num_steps", "positive integer", True),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": -3}},
     "scheduler.params.lr_range_test_step_size", "positive integer", True),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0, 0.0]}}, "scheduler.params.warmup_min_lr",
     "a list of 2", True),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 0}},
     "scheduler.params.cycle_first_step_size", "positive", True),
    ({"type": "LambdaLR", "params": {}}, "scheduler.type", 'backend="deepspeed"', False),
    ({"type": "ReduceLROnPlateau", "params": {}}, "scheduler.type", 'backend="deepspeed"', False),
    ({"type": "StepLR", "params": {"step": 3}}, "scheduler.params.step", "rename it 'step_size'", True),
]


@pytest.mark.parametrize(("section", "key", "fix", "deepspeed_refuses"), SCHEDULE_REFUSALS,
                         ids=[f"{s['type']}-{k.rsplit('.', 1)[-1]}" for s, k, _, _ in SCHEDULE_REFUSALS])
def test_scheduler_refusals_name_the_fix(section: dict[str, Any], key: str, fix: str, deepspeed_refuses: bool,
                                         ds: types.SimpleNamespace) -> None:
    with pytest.raises(ConfigError) as caught:
        build_scheduler(section, _adamw())
    assert caught.value.key == key and caught.value.fix and fix in caught.value.fix, caught.value
    if deepspeed_refuses:
        name = section["type"]
        cls = getattr(ds.schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
        with pytest.raises((TypeError, ValueError, AssertionError)):
            assert cls is not None, "DeepSpeed does not recognize it"
            cls(_adamw(), **section.get("params", {}))


# ----------------------------------------------------------------------------- optimizers


def _params(seed: int = 1) -> list[torch.nn.Parameter]:
    """Odd sizes (past the kernels' SIMD tiles, and their tails), two of them in a second group below."""
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape)) for shape in ((37, 5), (37,), (129,), (3, 3))]


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}, {"params": []}]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 5) -> None:
    """``steps`` steps on the same gradients for every optimizer."""
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


def _stand_in(ds: types.SimpleNamespace, section: dict[str, Any], offloaded: bool) -> Any:
    """Enough of a DeepSpeedEngine for its own ``_configure_basic_optimizer`` to choose and build."""
    name = section["type"].lower() if section["type"].lower() in ds.OWN else section["type"]
    engine = types.SimpleNamespace(optimizer_params=lambda: section.get("params", {}), optimizer_name=lambda: name,
                                   zero_use_cpu_optimizer=lambda: offloaded, zenflow=False,
                                   bf16_optimizer_states=lambda: False, has_moe_layers=False)
    engine.get_optimizer_configuration = functools.partial(ds.Engine.get_optimizer_configuration, engine)
    return engine


def _deepspeeds(ds: types.SimpleNamespace, section: dict[str, Any], params: list[Any], offloaded: bool) -> Any:
    """The optimizer DeepSpeed's engine builds, empty groups removed as its ``_configure_optimizer`` does."""
    optimizer = ds.Engine._configure_basic_optimizer(_stand_in(ds, section, offloaded), params)
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if len(g["params"]) != 0]
    return optimizer


_OPS = {"FusedAdam": "fused_adam", "DeepSpeedCPUAdam": "cpu_adam", "DeepSpeedCPUAdagrad": "cpu_adagrad"}


def _need_op(kernel: str) -> None:
    """Skip unless DeepSpeed's C++ op for ``kernel`` is built already (building it takes minutes)."""
    op = _OPS[kernel.split("(")[0]]
    if not (Path(os.environ["TORCH_EXTENSIONS_DIR"]) / op / f"{op}.so").exists():
        pytest.skip(f"DeepSpeed's {op} op is not built in $TORCH_EXTENSIONS_DIR (see the module docstring)")


OPTIMIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    "adamw-defaults": ({"type": "AdamW", "params": {"lr": 1e-2}}, False),
    "adam-default-w-mode": ({"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}}, False),
    "adam-l2": ({"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False, "weight_decay": 0.05,
                                            "betas": [0.8, 0.95], "eps": 1e-6}}, False),
    "adamw-ignores-w-mode": ({"type": "AdamW", "params": {"lr": 1e-2, "adam_w_mode": False,
                                                          "weight_decay": 0.1}}, False),
    "adam-mechanics": ({"type": "ADAM", "params": {"lr": 1e-2, "bias_correction": True, "amsgrad": False,
                                                   "set_grad_none": False, "fp32_optimizer_states": True}}, False),
    "adamw-defaults-offloaded": ({"type": "AdamW", "params": {"lr": 1e-2}}, True),
    "adam-decay-offloaded": ({"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}}, True),
    "adam-l2-offloaded": ({"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False, "weight_decay": 0.05,
                                                      "betas": [0.8, 0.95]}}, True),
    "adamw-torch": ({"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, False),
    "adam-torch-l2-amsgrad": ({"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False,
                                                          "amsgrad": True, "weight_decay": 0.01,
                                                          "foreach": False}}, True),
    "adagrad": ({"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.001, "eps": 1e-9}}, False),
    "adagrad-offloaded": ({"type": "adagrad", "params": {"lr": 0.05, "weight_decay": 0.01, "amsgrad": True}}, True),
    "sgd": ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, False),
    "rmsprop": ({"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "centered": True}}, False),
    "nadam": ({"type": "NAdam", "params": {"lr": 0.01, "momentum_decay": 0.002}}, True),
    "adamax": ({"type": "Adamax", "params": {}}, False),
}


def _kernel_adam(section: dict[str, Any], params: list[torch.nn.Parameter], group_lrs: list[float]) -> list[Any]:
    """DeepSpeed's Adam kernels (csrc/includes/cpu_adam.h, csrc/adam/multi_tensor_adam.cu) written out in float64:
    L2 mode adds ``weight_decay * p`` to the gradient, AdamW mode scales ``p`` by ``1 - lr * weight_decay``; both
    divide the bias-corrected first moment by ``sqrt(v) / sqrt(1 - beta2^t) + eps``. Defaults: the kernels'."""
    given = section.get("params", {})
    decoupled = section["type"].lower() == "adamw" or bool(given.get("adam_w_mode", True))
    beta1, beta2 = given.get("betas", (0.9, 0.999))
    eps, decay = given.get("eps", 1e-8), given.get("weight_decay", 0.0)
    values = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(v) for v in values]
    v2 = [torch.zeros_like(v) for v in values]
    lrs = [group_lrs[0]] * 2 + [group_lrs[1]] * 2
    for step in range(1, 6):
        generator = torch.Generator().manual_seed(100 + step - 1)
        for i, p in enumerate(values):
            g = torch.randn(p.shape, generator=generator).double()
            if not decoupled:
                g = g + decay * p
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v2[i] = beta2 * v2[i] + (1 - beta2) * g * g
            denom = v2[i].sqrt() / (1 - beta2**step) ** 0.5 + eps
            if decoupled:
                p.mul_(1 - lrs[i] * decay)
            p.add_(-lrs[i] / (1 - beta1**step) * m[i] / denom)
    return values


@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_optimizer_equals_deepspeeds(case: str, ds: types.SimpleNamespace) -> None:
    section, offloaded = OPTIMIZERS[case]
    choice = resolve_optimizer(section, offloaded=offloaded)
    if not choice.exact:
        _need_op(choice.deepspeed_builds)
    mine, theirs = _params(), _params()
    ours = build_optimizer(section, _groups(mine), offloaded=offloaded)
    deepspeeds = _deepspeeds(ds, section, _groups(theirs), offloaded)
    assert type(ours) is choice.torch_class
    built = type(deepspeeds).__name__
    assert choice.deepspeed_builds.split("(")[0] == (f"torch.optim.{built}" if choice.exact else built)
    if hasattr(deepspeeds, "adam_w_mode"):  # the mode DeepSpeed's engine passed its kernel
        assert choice.deepspeed_builds.endswith(f"_mode={bool(deepspeeds.adam_w_mode)})")
    assert len(ours.param_groups) == len(deepspeeds.param_groups) == 2
    for group, other in zip(ours.param_groups, deepspeeds.param_groups):
        shared = set(group) & set(other) - {"params"}
        same = {k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k in shared}
        assert same == {k: tuple(v) if isinstance(v, list) else v for k, v in other.items() if k in shared}
    _run(ours, mine)
    _run(deepspeeds, theirs)
    for p, q in zip(mine, theirs):
        if choice.exact:
            assert torch.equal(p, q)  # the same torch class with the same keywords
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in OPTIMIZERS if "adam" in OPTIMIZERS[c][0]["type"].lower()
                                  and "torch" not in c and "nadam" not in c and "adamax" not in c])
def test_adam_update_is_deepspeeds_kernel_formula(case: str) -> None:
    """Without DeepSpeed's ops: our optimizer against the kernels' formula."""
    section, offloaded = OPTIMIZERS[case]
    mine = _params()
    ours = build_optimizer(section, _groups(mine), offloaded=offloaded)
    _run(ours, mine)
    expected = _kernel_adam(section, _params(), [section["params"]["lr"], 5e-3])
    for p, q in zip(mine, expected):
        torch.testing.assert_close(p.double(), q, rtol=1e-6, atol=1e-6)


OPTIMIZER_REFUSALS: list[tuple[dict[str, Any], bool, str, str, bool]] = [
    # (section, offloaded, key, a piece of the fix, whether DeepSpeed refuses it too here)
    ({"type": "Lamb", "params": {"lr": 1e-3}}, False, "optimizer.type", OWN_OPTIMIZER, False),
    ({"type": "lion", "params": {}}, True, "optimizer.type", OWN_OPTIMIZER, False),
    ({"type": "MuAdam", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, False),
    ({"type": "MuAdamW", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, False),
    ({"type": "MuSGD", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, False),
    ({"type": "Muon", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, False),
    ({"type": "OneBitAdam", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, True),
    ({"type": "ZeroOneAdam", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, True),
    ({"type": "OneBitLamb", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, True),
    ({"type": "LBFGS", "params": {}}, False, "optimizer.type", OWN_OPTIMIZER, False),
    ({"type": "sgd", "params": {"lr": 0.1}}, False, "optimizer.type", "write 'SGD'", True),
    ({"type": "Adafactorr", "params": {}}, False, "optimizer.type", "write 'Adafactor'", True),
    ({"type": "AdamW", "params": {"lr": "auto"}}, False, "optimizer.params.lr", "write the value", False),
    ({"type": "AdamW", "params": {"betas": ["auto", 0.999]}}, False, "optimizer.params.betas", "write the value",
     False),
    ({"type": "AdamW", "params": {"amsgrad": True}}, False, "optimizer.params.amsgrad", "torch_adam", True),
    ({"type": "Adam", "params": {"amsgrad": True}}, True, "optimizer.params.amsgrad", "torch_adam", True),
    ({"type": "AdamW", "params": {"bias_correction": False}}, False, "optimizer.params.bias_correction",
     OWN_OPTIMIZER, False),
    ({"type": "AdamW", "params": {"set_grad_none": True}}, True, "optimizer.params.set_grad_none", "remove it",
     True),
    ({"type": "AdamW", "params": {"adamw_mode": False}}, False, "optimizer.params.adamw_mode",
     "rename it 'adam_w_mode'", True),
    ({"type": "AdamW", "params": {"foreach": True}}, False, "optimizer.params.foreach", "torch_adam", True),
    ({"type": "AdamW", "params": {"torch_adam": True, "bias_correction": True}}, False,
     "optimizer.params.bias_correction", "remove it", True),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, False, "optimizer.params.max_grad_norm",
     "gradient_clipping", True),
    ({"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}, False, "optimizer.params.betas", "remove it",
     True),
    ({"type": "Adagrad", "params": {"lr_decay": 0.01}}, True, "optimizer.params.lr_decay", "remove it", True),
]


@pytest.mark.parametrize(("section", "offloaded", "key", "fix", "deepspeed_refuses"), OPTIMIZER_REFUSALS,
                         ids=[f"{s['type']}-{k.rsplit('.', 1)[-1]}{'-offloaded' if o else ''}"
                              for s, o, k, _, _ in OPTIMIZER_REFUSALS])
def test_optimizer_refusals_name_the_fix(section: dict[str, Any], offloaded: bool, key: str, fix: str,
                                         deepspeed_refuses: bool, ds: types.SimpleNamespace) -> None:
    with pytest.raises(ConfigError) as caught:
        build_optimizer(section, _params(), offloaded=offloaded)
    assert caught.value.key == key and caught.value.fix and fix in caught.value.fix, caught.value
    if deepspeed_refuses:
        with pytest.raises((TypeError, ValueError, RuntimeError, AttributeError)):
            _deepspeeds(ds, section, _params(), offloaded)


def test_weight_decay_defaults_follow_the_class_deepspeed_picks() -> None:
    assert resolve_optimizer({"type": "AdamW"}).kwargs["weight_decay"] == 0.0  # FusedAdam's
    assert resolve_optimizer({"type": "AdamW"}, offloaded=True).kwargs["weight_decay"] == 0.0  # DeepSpeedCPUAdam's
    torch_adam = build_optimizer({"type": "AdamW", "params": {"torch_adam": True}}, _params())
    assert torch_adam.defaults["weight_decay"] == 0.01  # torch's AdamW default: DeepSpeed passes nothing
    assert type(build_optimizer({"type": "Adam", "params": {"adam_w_mode": False}}, _params())) is torch.optim.Adam


# ----------------------------------------------------------------------------- the comparisons catch a broken rule


def test_a_missing_warmup_lag_is_caught(monkeypatch: pytest.MonkeyPatch, ds: types.SimpleNamespace) -> None:
    """Reading DeepSpeed's value at ``last_epoch`` instead of ``last_epoch - 1`` (Trainer's convention)."""
    monkeypatch.setattr(WarmupLR, "get_lr", lambda self: self.lrs_at(self.last_epoch))
    with pytest.raises(AssertionError, match="lr after 1 steps"):
        test_schedule_equals_deepspeeds_at_every_step("warmup-linear", ds)


def test_a_wrong_beta2_is_caught(monkeypatch: pytest.MonkeyPatch, ds: types.SimpleNamespace) -> None:
    """OneCycle keeping the optimizer's beta2 instead of setting DeepSpeed's 0.99."""
    monkeypatch.setattr(OneCycle, "BETA2", 0.995)
    with pytest.raises(AssertionError, match="betas after 0 steps"):
        test_schedule_equals_deepspeeds_at_every_step("onecycle-momentum", ds)


def test_torchs_adamw_decay_default_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.optim.AdamW's weight_decay 0.01 where DeepSpeed's kernels default to 0."""
    monkeypatch.setattr(optimizers, "_ADAM_DEFAULTS", {**optimizers._ADAM_DEFAULTS, "weight_decay": 0.01})
    with pytest.raises(AssertionError):
        test_adam_update_is_deepspeeds_kernel_formula("adamw-defaults")

