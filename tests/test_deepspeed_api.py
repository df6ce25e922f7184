"""``import zerobridge.deepspeed as deepspeed``: a DeepSpeed script changed only in its import line matches DeepSpeed.

The script is ``zerobridge.testing.deepspeed_script`` (``--flavor real`` imports ``deepspeed``, ``--flavor
zerobridge`` imports ``zerobridge.deepspeed``; nothing else differs). Each launch runs every config of ``CONFIGS``
(one optimizer/scheduler pair each, ZeRO-2 or ZeRO-3, accumulation 2, clipping that bites) for ``STEPS``
micro-steps at world 2 (gloo on CPU), so a launch covers all three pairs. ``zerobridge`` runs on
``ZEROBRIDGE_BACKEND=native``, ``fsdp`` (with ``ZEROBRIDGE_ALLOW_APPROXIMATE=1``, which ``zerobridge run
--allow-approximate`` sets: FSDP2 shards ZeRO-2's parameters between steps, the same numbers) and ``deepspeed``;
every micro-step must match real DeepSpeed's: each rank's loss within ``LOSS_RTOL``, ``get_lr()`` before and after
``step()`` within ``LR_RTOL``, ``get_global_grad_norm()`` at each boundary within ``GRAD_NORM_RTOL`` (relative), and
the same ``is_gradient_accumulation_boundary()``, ``global_steps``, ``global_samples`` and ``micro_steps``.

Resume: the native and FSDP launches save after micro-step ``SAVE_AT`` (``save_checkpoint(dir, tag=TAG,
client_state=CLIENT_STATE)``); a fresh launch on the other backend loads it (``load_checkpoint(dir)``, the tag in
``latest``) and continues. Its micro-steps must equal real DeepSpeed's uninterrupted run with the same tolerances,
its counters those of DeepSpeed's own resume (which restores ``global_steps`` and ``global_samples`` and restarts
``micro_steps``), and the client state must come back.

Real DeepSpeed builds FusedAdam (its CPU C++ op, JIT-built into ``$TORCH_EXTENSIONS_DIR`` once) for the Adam and
AdamW sections: zerobridge's torch Adam/AdamW agree with it to float32 rounding (~1e-7 relative on the losses).

Each launch is ``main(argv)`` of the script on every rank of a fresh 2-process group (``Cluster``, which sets the
variables torchrun sets; its workers are forked with torch, and DeepSpeed where the launch imports it, already
imported), not a torchrun of the script: the script is the client here, the launcher is not (``tests/test_faults.py``
launches with torchrun). Cost: seven launches of ~2-5 s on 2 CPU cores (``Launches`` caches each for the module);
the unit tests at the end need no process group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO
from torch import nn

import zerobridge.deepspeed as zb_deepspeed
from zerobridge.compare.runner import DEEPSPEED_PRELOAD
from zerobridge.deepspeed import REFUSED, DeepSpeedEngine
from zerobridge.deepspeed.config import read_config
from zerobridge.errors import ConfigError
from zerobridge.harness.cluster import PRELOAD, Cluster, RankError
from zerobridge.testing.deepspeed_script import CLIENT_STATE

os.environ.setdefault("DS_ACCELERATOR", "cpu")

WORLD = 2
STEPS = 10
SAVE_AT = 6
"""Micro-steps before the save: a boundary (accumulation 2), after 3 optimizer steps."""
TAG = "step6"
LOSS_RTOL = 1e-5
LR_RTOL = 1e-9
GRAD_NORM_RTOL = 1e-4
LAUNCH_TIMEOUT_S = 600  # the first DeepSpeed launch may JIT-build FusedAdam and the shm comm op (~2 min)

_COMMON: dict[str, Any] = {"gradient_accumulation_steps": 2, "steps_per_print": 1000}
CONFIGS: dict[str, dict[str, Any]] = {
    "adamw_decay": {
        **_COMMON, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_min_lr": 0.001,
                                                          "warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                                          "warmup_type": "linear"}}},
    # Adam with L2 weight decay (adam_w_mode false); WarmupLR's default log warmup; the batch as train_batch_size.
    "adam_l2_warmup": {
        **_COMMON, "train_batch_size": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "Adam", "params": {"lr": 0.005, "adam_w_mode": False, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.005,
                                                     "warmup_num_steps": 3}}},
    "sgd_cosine": {
        **_COMMON, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.3, "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                           "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}}},
}
"""One optimizer/scheduler pair each, as DeepSpeed reads them (its engine builds FusedAdam for Adam and AdamW)."""
BACKENDS = ("native", "fsdp", "deepspeed")
RESUMES = (("native", "fsdp"), ("fsdp", "native"))
"""(saved on, resumed on)."""
BACKEND_CLASS = {"native": "NativeBackend", "fsdp": "FsdpBackend", "deepspeed": "DeepSpeedBackend"}
REAL_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"


def _errors(log: str) -> str:
    """The lines of a failed launch's stderr worth reading: tracebacks and errors, not the warnings."""
    keep = [line for line in log.splitlines()
            if not line.startswith(("  return func(", "  warnings.warn(")) and "Warning" not in line]
    return "\n".join(keep[-120:])


class Launches:
    """``deepspeed_script`` launches at world 2 over every config of ``CONFIGS``, each once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple[str, str | None, str | None], dict[str, Any]] = {}
        self.configs: list[Path] = []
        for name, config in CONFIGS.items():
            path = root / f"{name}.json"
            path.write_text(json.dumps(config, indent=1), encoding="utf-8")
            self.configs.append(path)
        self.env = os.environ | {
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }

    def checkpoints(self, flavor: str, backend: str | None) -> Path:
        """Where the uninterrupted launch of ``flavor`` on ``backend`` saves (one directory per config)."""
        return self.root / f"ckpt-{flavor}-{backend}"

    def run(self, flavor: str, backend: str | None = None, *, resume_from: str | None = None) -> dict[str, Any]:
        """The record of ``flavor`` (``real``, or ``zerobridge`` on ``backend``): uninterrupted (saving after
        ``SAVE_AT`` micro-steps), or resumed from what the uninterrupted launch of the same flavor on
        ``resume_from`` saved (``resume_from="real"``: real DeepSpeed's own)."""
        key = (flavor, backend, resume_from)
        if key not in self.cache:
            name = "-".join(str(k) for k in key if k is not None)
            out = self.root / f"{name}.json"
            flags = [a for c in self.configs for a in ("--config", str(c))]
            if resume_from is None:
                flags += ["--save", str(self.checkpoints(flavor, backend)), "--tag", TAG, "--save-at", str(SAVE_AT)]
            else:
                saved_on = None if flavor == "real" else resume_from
                self.run(flavor, saved_on)
                flags += ["--resume", str(self.checkpoints(flavor, saved_on))]
            env = dict(self.env)
            env.pop("ZEROBRIDGE_BACKEND", None)
            if backend is not None:
                approximate = "1" if backend == "fsdp" else "0"  # FSDP2 runs ZeRO-2 as reshard_after_forward=False
                env |= {"ZEROBRIDGE_BACKEND": backend, "ZEROBRIDGE_ALLOW_APPROXIMATE": approximate}
            self.cache[key] = self._launch(name, env, ["--flavor", flavor, "--steps", str(STEPS), "--out", str(out),
                                                       *flags], out)
        return self.cache[key]

    def _launch(self, name: str, env: dict[str, str], flags: list[str], out: Path) -> dict[str, Any]:
        """The script's ``main(flags)`` on every rank of a fresh 2-process group (``Cluster``: torchrun's
        variables, workers forked with torch, and DeepSpeed where the launch imports it, already loaded)."""
        real = "--flavor" in flags and flags[flags.index("--flavor") + 1] == "real"
        preload = (*PRELOAD, *(DEEPSPEED_PRELOAD if real or env.get("ZEROBRIDGE_BACKEND") == "deepspeed" else ()))
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        gone = [k for k in ("ZEROBRIDGE_BACKEND", "ZEROBRIDGE_ALLOW_APPROXIMATE") if k in os.environ and k not in env]
        assert not gone, f"unset {gone} before the module runs: a launch's workers inherit this environment"
        try:
            with Cluster(WORLD, timeout_s=LAUNCH_TIMEOUT_S, env=extra, preload=preload) as cluster:
                cluster.run("zerobridge.testing.deepspeed_script:main", argv=flags)
        except RankError as exc:
            raise AssertionError(f"deepspeed_script {' '.join(flags)} failed:\n{_errors(str(exc))}") from None
        record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        assert record["world_size"] == WORLD and sorted(record["runs"]) == sorted(CONFIGS)
        return record


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    pytest.importorskip("deepspeed")
    if any(c.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw") for c in CONFIGS.values()):
        try:  # FusedAdam, DeepSpeed's CPU op: built once here, not by both ranks at once
            from deepspeed.ops.op_builder import FusedAdamBuilder

            FusedAdamBuilder().load()
        except Exception as exc:  # no compiler or headers
            pytest.skip(f"DeepSpeed cannot build FusedAdam here: {str(exc).splitlines()[0]}")
    return Launches(tmp_path_factory.mktemp("deepspeed_api"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def compare(reference: list[dict[str, Any]], got: list[dict[str, Any]], *,
            counters: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Max relative deviations (loss, lr, grad norm) of ``got`` from ``reference`` over the micro-steps ``got``
    ran, asserting the tolerances and equal boundaries; the counters equal those of ``counters`` (default: the
    reference's own)."""
    by_step = {s["step"]: s for s in reference}
    assert got and all(s["step"] in by_step for s in got), [s["step"] for s in got]
    counted = {s["step"]: s for s in (counters if counters is not None else reference)}
    worst = {"loss": 0.0, "lr": 0.0, "grad_norm": 0.0}
    for step in got:
        ref, n = by_step[step["step"]], step["step"]
        assert step["boundary"] == ref["boundary"], f"micro-step {n}: boundary {step['boundary']} vs {ref['boundary']}"
        for name in ("global_steps", "global_samples", "micro_steps"):
            assert step[name] == counted[n][name], f"micro-step {n}: {name} {step[name]} vs {counted[n][name]}"
        assert len(step["loss"]) == len(ref["loss"]) == WORLD
        worst["loss"] = max(worst["loss"], *(_rel(a, b) for a, b in zip(ref["loss"], step["loss"])))
        lrs = list(zip(ref["lr"] + ref["lr_after"], step["lr"] + step["lr_after"], strict=True))
        worst["lr"] = max(worst["lr"], *(_rel(a, b) if a else abs(b) for a, b in lrs))
        if ref["boundary"]:
            assert ref["grad_norm"] is not None and step["grad_norm"] is not None, f"micro-step {n}: no grad norm"
            worst["grad_norm"] = max(worst["grad_norm"], _rel(ref["grad_norm"], step["grad_norm"]))
    detail = f"\nreference {json.dumps(reference)}\ngot {json.dumps(got)}"
    assert worst["loss"] <= LOSS_RTOL, f"loss deviates {worst['loss']:.2e}{detail}"
    assert worst["lr"] <= LR_RTOL, f"lr deviates {worst['lr']:.2e}{detail}"
    assert worst["grad_norm"] <= GRAD_NORM_RTOL, f"grad norm deviates {worst['grad_norm']:.2e}{detail}"
    return worst


def _report(record_property: Any, label: str, worst: dict[str, float]) -> None:
    for name, value in worst.items():
        record_property(f"max_{name}_deviation", value)
    print(f"\n{label}: max relative deviation loss {worst['loss']:.2e}, lr {worst['lr']:.2e}, "
          f"grad norm {worst['grad_norm']:.2e}")


# --------------------------------------------------------------------------- the script against real DeepSpeed


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_script_matches_real_deepspeed(config: str, backend: str, launches: Launches, record_property: Any) -> None:
    real = launches.run("real")["runs"][config]
    ours = launches.run("zerobridge", backend)["runs"][config]
    stage = CONFIGS[config]["zero_optimization"]["stage"]
    # What trained: guards against comparing DeepSpeed with itself, or zerobridge with zerobridge.
    assert (real["engine"], real["stage"]) == (REAL_ENGINE, stage)
    assert (ours["engine"], ours["stage"]) == ("zerobridge.deepspeed.engine.DeepSpeedEngine", stage)
    assert ours["backend"] == BACKEND_CLASS[backend]
    assert (ours["wraps"] == REAL_ENGINE) == (backend == "deepspeed")
    assert [s["step"] for s in real["micro_steps"]] == [s["step"] for s in ours["micro_steps"]] == list(range(STEPS))
    assert [s["boundary"] for s in real["micro_steps"]] == [n % 2 == 1 for n in range(STEPS)]
    assert real["micro_steps"][-1]["global_steps"] == STEPS // 2
    worst = compare(real["micro_steps"], ours["micro_steps"])
    _report(record_property, f"{config} (ZeRO-{stage}) on {backend}", worst)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("saved_on", "resumed_on"), RESUMES, ids=[f"{a}-to-{b}" for a, b in RESUMES])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_resume_on_another_backend_continues_the_run(config: str, saved_on: str, resumed_on: str,
                                                     launches: Launches, record_property: Any) -> None:
    real = launches.run("real")["runs"][config]
    real_resumed = launches.run("real", resume_from="real")["runs"][config]
    resumed = launches.run("zerobridge", resumed_on, resume_from=saved_on)["runs"][config]
    assert resumed["backend"] == BACKEND_CLASS[resumed_on]
    at_save = real["micro_steps"][SAVE_AT - 1]
    loaded = resumed["loaded"]
    assert loaded["client_state"] == CLIENT_STATE
    assert real_resumed["loaded"]["client_state"].items() >= CLIENT_STATE.items()  # DeepSpeed adds its own keys
    assert Path(loaded["path"]) == launches.checkpoints("zerobridge", saved_on) / config / TAG
    assert (loaded["global_steps"], loaded["global_samples"]) == (at_save["global_steps"], at_save["global_samples"])
    assert loaded["lr"] == pytest.approx(at_save["lr_after"], rel=LR_RTOL)
    assert [s["step"] for s in resumed["micro_steps"]] == list(range(SAVE_AT, STEPS))
    worst = compare(real["micro_steps"], resumed["micro_steps"], counters=real_resumed["micro_steps"])
    _report(record_property, f"{config} saved on {saved_on}, resumed on {resumed_on}", worst)


# --------------------------------------------------------------------------- without a process group

BATCH: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


def _engine(config: dict[str, Any] | None = None) -> DeepSpeedEngine:
    """An engine over a plain module and no optimizer: enough for what needs no step."""
    return DeepSpeedEngine(nn.Linear(2, 2), None, None, read_config(config or BATCH, world_size=WORLD))


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                 "gradient_clipping"])
def test_read_config_refuses_auto(key: str) -> None:
    with pytest.raises(ConfigError, match="only HF Trainer and Accelerate fill it") as caught:
        read_config({**BATCH, key: "auto"}, world_size=WORLD)
    assert caught.value.key == key
    assert caught.value.fix is not None and "zerobridge convert" in caught.value.fix


@pytest.mark.parametrize(("batch", "expected"), [
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, (2, 2, 8)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (2, 4, 16)),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, (2, 2, 8)),
    ({"train_micro_batch_size_per_gpu": 3}, (3, 1, 6)),
])
def test_read_config_batch_identity(batch: dict[str, Any], expected: tuple[int, int, int]) -> None:
    run = read_config(batch, world_size=WORLD)
    assert (run.micro_batch, run.accumulation, run.train_batch) == expected


@pytest.mark.parametrize("batch", [
    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
    {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1},
    {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2},
    {"train_batch_size": 2, "gradient_accumulation_steps": 2},
])
def test_read_config_refuses_a_batch_mismatch_for_the_world_size(batch: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="x world size 2") as caught:
        read_config(batch, world_size=WORLD)
    assert caught.value.key == "train_batch_size" and caught.value.fix


def test_read_config_refuses_a_batch_that_divides_no_world_size() -> None:
    with pytest.raises(ConfigError, match="global_batch_size=10 is not a multiple of micro_batch_size x "
                                          "accumulation_steps = 2 x 2"):
        read_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
                    world_size=WORLD)


def test_read_config_needs_a_batch_size() -> None:
    with pytest.raises(ConfigError, match="neither train_batch_size nor train_micro_batch_size_per_gpu"):
        read_config({"gradient_accumulation_steps": 2}, world_size=WORLD)


def test_read_config_reads_a_path_and_takes_the_sections_out(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIGS["adamw_decay"]), encoding="utf-8")
    run = read_config(path, world_size=WORLD)
    assert (run.source, run.stage, run.clip, run.train_batch) == (str(path), 2, 0.5, 8)
    assert run.optimizer == CONFIGS["adamw_decay"]["optimizer"]
    assert run.scheduler == CONFIGS["adamw_decay"]["scheduler"]
    carried = run.spec.passthrough.get("deepspeed", {})
    assert "optimizer" not in carried and "scheduler" not in carried


@pytest.mark.parametrize("twice", [
    {"config": BATCH, "config_params": BATCH},
    {"config": BATCH, "args": Namespace(deepspeed_config="ds.json")},
    {"config_params": BATCH, "args": Namespace(deepspeed_config="ds.json")},
], ids=["config-and-config_params", "config-and-args", "config_params-and-args"])
def test_initialize_refuses_the_config_given_twice(twice: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="the config is given twice") as caught:
        zb_deepspeed.initialize(model=nn.Linear(2, 2), **twice)
    assert caught.value.fix == "pass it once"


def test_initialize_needs_a_config_and_a_model() -> None:
    with pytest.raises(ConfigError, match="no DeepSpeed config"):
        zb_deepspeed.initialize(model=nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="needs model="):
        zb_deepspeed.initialize(config=BATCH)


@pytest.mark.parametrize("name", ["mpu", "mesh_param"])
def test_initialize_refuses_model_parallelism(name: str) -> None:
    parallel: dict[str, Any] = {name: object()}
    with pytest.raises(ConfigError, match="model or sequence parallelism") as caught:
        zb_deepspeed.initialize(model=nn.Linear(2, 2), config=BATCH, **parallel)
    assert caught.value.key == name
    assert caught.value.fix is not None and "keep `import deepspeed`" in caught.value.fix


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_engine_calls_raise_with_the_fix(name: str) -> None:
    with pytest.raises(NotImplementedError, match=re.escape(REFUSED[name])) as caught:
        getattr(_engine(), name)
    assert f"DeepSpeedEngine.{name}" in str(caught.value)


def test_refused_names_are_deepspeed_engine_calls() -> None:
    """Each refused name is a call DeepSpeed's engine (or its pipeline engine) has: the list names real calls."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine as RealEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert [n for n in REFUSED if not hasattr(RealEngine, n) and not hasattr(PipelineEngine, n)] == []


def test_refused_arguments_and_unknown_attributes() -> None:
    engine = _engine()
    with pytest.raises(NotImplementedError, match="scale_wrt_gas=False"):
        engine.backward(torch.zeros((), requires_grad=True), scale_wrt_gas=False)
    with pytest.raises(NotImplementedError, match="exclude_frozen_parameters"):
        engine.save_checkpoint("unused", exclude_frozen_parameters=True)
    with pytest.raises(AttributeError, match="no_such_call"):
        engine.no_such_call  # noqa: B018 - the attribute access is the test


def test_engine_reads_the_config() -> None:
    engine = _engine({**BATCH, "gradient_clipping": 1.5, "zero_optimization": {"stage": 3}})
    assert (engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(), engine.train_batch_size(),
            engine.gradient_clipping(), engine.zero_optimization_stage()) == (2, 2, 8, 1.5, 3)
    assert (engine.world_size, engine.global_rank, engine.get_lr(), engine.get_global_grad_norm()) == (1, 0, [], None)


def test_counters_between_boundaries_are_deepspeeds() -> None:
    """DeepSpeed adds ``train_batch_size`` samples at a boundary only; ``micro_steps`` counts every ``step()``."""
    engine = _engine()
    assert engine.is_gradient_accumulation_boundary() is False
    engine.step()  # not a boundary: no optimizer needed
    assert (engine.micro_steps, engine.global_steps, engine.global_samples) == (1, 0, 0)
    assert engine.is_gradient_accumulation_boundary() is True
    with pytest.raises(RuntimeError, match="step\\(\\) needs an optimizer"):
        engine.step()
    engine.set_gradient_accumulation_boundary(False)
    assert engine.is_gradient_accumulation_boundary() is False


def test_load_checkpoint_without_latest_warns_and_loads_nothing(tmp_path: Path) -> None:
    engine = _engine()
    with pytest.warns(UserWarning, match="nothing loaded"):
        assert engine.load_checkpoint(tmp_path) == (None, None)


# --------------------------------------------------------------------------- no hidden random draws

_RNG_PROBE = r'''
import json, random, sys
import numpy as np
import torch
from torch import nn
import zerobridge
import zerobridge.deepspeed as deepspeed


def state():
    cuda = [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return [torch.get_rng_state().tolist(), cuda, repr(random.getstate()), np.random.get_state()[1].tolist()]


def net():
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))


torch.manual_seed(0), random.seed(0), np.random.seed(0)
changed = {}
before = state()
deepspeed.init_distributed()
changed["init_distributed"] = state() != before
for backend in ("native", "fsdp"):
    for stage in (0, 3):
        model = net()
        before = state()
        zerobridge.prepare(model, stage=stage, backend=backend, allow_approximate=True)
        changed[f"prepare {backend} stage {stage}"] = state() != before
model = net()
before = state()
deepspeed.initialize(model=model, model_parameters=model.parameters(),
                     config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
changed["initialize"] = state() != before
print(json.dumps(changed))
'''


def test_entry_points_leave_the_random_state_alone() -> None:
    """``init_distributed``, ``initialize`` and ``prepare`` draw no random numbers (torch CPU and CUDA, Python's
    ``random``, numpy): a script seeded before them gets the same dropout masks whichever import line it has.
    Fresh process: ``init_distributed`` is measured where it starts the group."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _RNG_PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(changed) == 6 and not any(changed.values()), changed
