"""``zerobridge checkpoint export-deepspeed``: a zerobridge checkpoint becomes one real DeepSpeed resumes from.

Two launches of ``zerobridge.testing.deepspeed_script`` at world 2 (gloo, CPU). The first runs
``zerobridge.deepspeed`` on the native engine at ZeRO-3 for ``STEPS`` micro-steps with AdamW, a JSON
``WarmupDecayLR`` still changing at the save and clipping, saving after ``SAVE_AT`` (with the script's
``client_state``). That checkpoint is exported for every config of ``TARGETS`` (ZeRO 1, 2, 3 with DeepSpeed's
FusedAdam; ZeRO-2 with torch's AdamW), plus one export of a copy whose Adam moments were zeroed. The second
launch is real DeepSpeed: ``engine.load_checkpoint(dir)`` on each export, then the remaining micro-steps and
a save of its own after micro-step ``OWN_SAVE_AT``, and the ``FRESH`` configs from scratch with the same save.
Every resumed loss equals the uninterrupted zerobridge run's within 1e-5 relative, every lr (before and after
each step) and counter equal, the client state comes back; the zeroed-moments export is caught by the same
comparison; each export holds the same files, keys (in order), types, shapes, dtypes and layout values as
DeepSpeed's own saves of that config.

Then a ``Cluster`` of two runs real DeepSpeed on ``BufferedParityNet`` (tied embedding/head, a frozen layer,
an unused one, buffers, two param groups) at stages 1-3, with round-robin order and alignment padding at
stage 2 and sub-groups at stage 3: after ``load_checkpoint`` of an export every parameter, buffer and Adam
moment it holds is the exported one, bit for bit, and its own next save has the export's layout.

The tests below them need no process group: exports of a hand-made checkpoint read back by
``import_deepspeed_checkpoint`` (checked against DeepSpeed itself in ``test_deepspeed_import.py``) at stages
1-3, world sizes 1-3 and each layout setting; the refusals; the command line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO

from zerobridge.checkpoint.deepspeed_export import export_deepspeed_checkpoint
from zerobridge.checkpoint.deepspeed_import import import_deepspeed_checkpoint
from zerobridge.checkpoint.deepspeed_target import read_target
from zerobridge.checkpoint.portable import PortableState, read_portable, write_portable
from zerobridge.checkpoint.storage import CheckpointError
from zerobridge.testing.deepspeed_script import CLIENT_STATE

WORLD, STEPS, SAVE_AT, OWN_SAVE_AT = 2, 6, 3, 5
LOSS_RTOL = 1e-5
BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_min_lr": 0.001,
                                                      "warmup_max_lr": 0.01, "warmup_num_steps": 3,
                                                      "warmup_type": "linear"}}}
SOURCE = BASE | {"zero_optimization": {"stage": 3}}
"""What zerobridge trains and saves (any stage would do)."""
TARGETS: dict[str, dict[str, Any]] = {
    "zero1": BASE | {"zero_optimization": {"stage": 1}},
    "zero2": BASE | {"zero_optimization": {"stage": 2}},
    "zero3": BASE | {"zero_optimization": {"stage": 3}},
    "zero2_torch_adamw": BASE | {"zero_optimization": {"stage": 2},
                                 "optimizer": {"type": "AdamW", "params": {**BASE["optimizer"]["params"],
                                                                           "torch_adam": True}}},
}
"""The DeepSpeed runs exported for: each resumes the same zerobridge checkpoint."""
FRESH = ("zero1", "zero3", "zero2_torch_adamw")
"""Also run by DeepSpeed from scratch (no checkpoint to load: it starts at step 0) and saved: the optimizer
files of a resumed run hold what it loaded (param groups, state keys, loss scaler), a fresh run's its own."""
ZEROED = "zero2_zeroed_moments"
"""An export of the same checkpoint with exp_avg and exp_avg_sq zeroed: what a lost optimizer state looks like."""
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
       "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")),
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(root: Path, name: str, flavor: str, configs: dict[str, dict[str, Any]], *flags: str) -> dict[str, Any]:
    """One ``deepspeed_script`` launch at world 2 over ``configs``; rank 0's record."""
    paths = []
    for stem, config in configs.items():
        paths += ["--config", str(root / f"{stem}.json")]
        (root / f"{stem}.json").write_text(json.dumps(config), encoding="utf-8")
    out = root / f"{name}.json"
    env = os.environ | ENV | {"ZEROBRIDGE_BACKEND": "native"}
    for attempt in (1, 2):  # the port picked here may be taken before torchrun binds it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), "-m", "zerobridge.testing.deepspeed_script",
               "--flavor", flavor, "--steps", str(STEPS), "--out", str(out), *paths, *flags]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode == 0 or attempt == 2 or "address already in use" not in proc.stderr.lower():
            break
    (root / f"{name}.stderr.log").write_text(proc.stderr, encoding="utf-8")
    errors = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warn" not in line]
    assert proc.returncode == 0, f"{name} failed (log in {root}):\n" + "\n".join(errors[-60:])
    record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return record


def zero_moments(source: Path, destination: Path) -> None:
    """``source`` with its Adam moments zeroed (weights, step, schedule and client state kept)."""
    state = read_portable(source)
    for entries in state.optimizer.values():
        for key in ("exp_avg", "exp_avg_sq"):
            entries[key] = torch.zeros_like(entries[key])
    write_portable(destination, state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted zerobridge run, the exports, and real DeepSpeed resumed from each."""
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:  # FusedAdam, DeepSpeed's CPU op: built once here, not by both ranks at once
        from deepspeed.ops.op_builder import FusedAdamBuilder

        FusedAdamBuilder().load()
    except Exception as exc:  # no compiler or headers
        pytest.skip(f"DeepSpeed cannot build FusedAdam here: {str(exc).splitlines()[0]}")
    root = tmp_path_factory.mktemp("deepspeed_export")
    zerobridge = launch(root, "zerobridge", "zerobridge", {"source": SOURCE}, "--save", str(root / "zb"),
                        "--save-at", str(SAVE_AT))["runs"]["source"]
    saved = root / "zb" / "source"  # a save directory: its 'latest' names the tag
    exports: dict[str, Path] = {}
    for name, target in TARGETS.items():  # as the command line does it, from the JSON file
        (root / f"{name}.json").write_text(json.dumps(target), encoding="utf-8")
        exports[name], _ = export_deepspeed_checkpoint(saved, root / "ds" / name, world_size=WORLD,
                                                       stage=target["zero_optimization"]["stage"],
                                                       config=root / f"{name}.json")
    zero_moments(saved / f"global_step{SAVE_AT}", root / "zeroed")
    exports[ZEROED], _ = export_deepspeed_checkpoint(root / "zeroed", root / "ds" / ZEROED, stage=2,
                                                     world_size=WORLD, config=TARGETS["zero2"])
    fresh = {f"fresh_{name}": TARGETS[name] for name in FRESH}  # nothing under ds/: load_checkpoint loads nothing
    real = launch(root, "deepspeed", "real", TARGETS | {ZEROED: TARGETS["zero2"]} | fresh, "--resume",
                  str(root / "ds"), "--save", str(root / "own"), "--save-at", str(OWN_SAVE_AT))
    assert real["flavor"] == "real" and real["world_size"] == WORLD
    return {"root": root, "zerobridge": zerobridge, "deepspeed": real["runs"], "exports": exports}


def deviations(reference: dict[str, Any], resumed: dict[str, Any]) -> list[float]:
    """Per resumed micro-step, the largest relative loss deviation of any rank from ``reference``;
    lrs and counters must be equal."""
    by_step = {s["step"]: s for s in reference["micro_steps"]}
    worst = []
    assert [s["step"] for s in resumed["micro_steps"]] == list(range(SAVE_AT, STEPS))
    for step in resumed["micro_steps"]:
        want = by_step[step["step"]]
        assert step["lr"] == pytest.approx(want["lr"], rel=1e-12), step["step"]
        assert step["lr_after"] == pytest.approx(want["lr_after"], rel=1e-12), step["step"]
        assert (step["global_steps"], step["global_samples"]) == (want["global_steps"], want["global_samples"])
        worst.append(max(abs(a - b) / abs(b) for a, b in zip(step["loss"], want["loss"], strict=True)))
    return worst


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
def test_deepspeed_resumes_where_zerobridge_left_off(runs: dict[str, Any], name: str) -> None:
    resumed, reference = runs["deepspeed"][name], runs["zerobridge"]
    assert resumed["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert resumed["stage"] == TARGETS[name]["zero_optimization"]["stage"]
    loaded = resumed["loaded"]
    assert loaded["path"].startswith(str(runs["exports"][name]))
    assert (loaded["global_steps"], loaded["global_samples"]) == (SAVE_AT, SAVE_AT * 2 * WORLD)
    assert loaded["lr"] == pytest.approx(reference["micro_steps"][SAVE_AT]["lr"], rel=1e-12)  # the schedule goes on
    assert {k: loaded["client_state"][k] for k in CLIENT_STATE} == CLIENT_STATE
    worst = deviations(reference, resumed)
    assert max(worst) <= LOSS_RTOL, f"{name}: relative loss deviations per resumed step {worst}"


@pytest.mark.distributed
@pytest.mark.slow
def test_lost_optimizer_state_fails_the_comparison(runs: dict[str, Any]) -> None:
    """The check above can fail: with the moments zeroed the first resumed loss (weights only) still agrees,
    the next ones do not."""
    worst = deviations(runs["zerobridge"], runs["deepspeed"][ZEROED])
    assert worst[0] <= LOSS_RTOL
    assert max(worst[1:]) > 100 * LOSS_RTOL, worst


def skeleton(value: Any) -> Any:
    """Types, keys in order, tensor shapes and dtypes of what ``torch.load`` returns; DeepSpeed's objects by
    class name and attributes."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        return (type(value).__name__, [(str(k), skeleton(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [skeleton(v) for v in value])
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return (f"{type(value).__module__}.{type(value).__qualname__}", skeleton(dict(vars(value))))
    return type(value).__name__


LAYOUT_KEYS = ("param_shapes", "buffer_names", "shared_params", "frozen_param_shapes", "dp_world_size",
               "mp_world_size", "group_paddings", "param_alignment_paddings", "partition_count", "zero_stage")


def layout(value: Any) -> Any:
    """The values that depend on the layout only (not on the step): shapes, paddings, partition counts,
    where each parameter's piece lies in a partition, the stage."""
    if isinstance(value, dict):
        found = {k: repr(v) for k, v in value.items() if k in LAYOUT_KEYS}
        found |= {k: [{name: (a.numel, a.start) for name, a in group.items()} for group in v]
                  for k, v in value.items() if k == "param_slice_mappings"}
        return found | {k: layout(v) for k, v in value.items() if isinstance(v, dict) and k != "module"}
    return None


def _files(tag_dir: Path) -> dict[str, Any]:
    loaded = {p.name: torch.load(p, weights_only=False) for p in sorted(tag_dir.glob("*.pt"))}
    return {name: (skeleton(value), layout(value)) for name, value in loaded.items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
def test_the_files_are_the_ones_deepspeed_writes(runs: dict[str, Any], name: str) -> None:
    """Same files, keys in order, types, shapes and dtypes, and the same layout values."""
    ours = _files(runs["exports"][name])
    saves = [runs["root"] / "own" / f"{run}{name}" / f"global_step{OWN_SAVE_AT}"
             for run in ("", "fresh_") if run == "" or name in FRESH]  # after resuming, and from scratch
    for own in map(_files, saves):
        assert list(ours) == list(own)
        for file, skeleton_ in ours.items():
            assert skeleton_ == own[file], file
    if name in FRESH:  # the fresh run did start from scratch
        assert runs["deepspeed"][f"fresh_{name}"]["loaded"]["path"] is None


# ---------------------------------------------------------------------------- DeepSpeed loads frozen, tied, buffers

ME = "test_deepspeed_export"
PARITY_STEPS = 5


def parity_source() -> PortableState:
    """``BufferedParityNet`` (tied embedding/head, a frozen layer listed in a group, an unused layer, two
    param groups, a float and an int64 buffer) as a zerobridge checkpoint after ``PARITY_STEPS`` steps of AdamW:
    made-up weights and state (every trainable parameter stepped), nothing trained."""
    from zerobridge.testing.deepspeed_run import BufferedParityNet
    from zerobridge.testing.parity import make_optimizer

    model = BufferedParityNet(seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen))
        model.calls.fill_(PARITY_STEPS)
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    state = {names[id(p)]: {"step": torch.tensor(float(PARITY_STEPS)), "exp_avg": torch.randn(p.shape, generator=gen),
                            "exp_avg_sq": torch.rand(p.shape, generator=gen)}
             for p in model.parameters() if p.requires_grad}
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return PortableState(model={k: v.detach().clone() for k, v in model.state_dict().items()}, optimizer=state,
                         param_groups=groups, client_state={"epoch": 1},
                         metadata={"deepspeed": {"global_steps": PARITY_STEPS, "global_samples": 4 * PARITY_STEPS,
                                                 "skipped_steps": 0}})


PARITY_LAYOUTS: dict[int, dict[str, Any]] = {
    1: {},
    2: {"round_robin_gradients": True, "parameter_alignment": True},  # ParityNet's odd sizes: real padding
    3: {"sub_group_size": 300},  # several sub-groups per param group
}
"""ZeRO settings per stage of the ParityNet check (the loss check above runs DeepSpeed's defaults)."""


def parity_config(stage: int) -> dict[str, Any]:
    """``train_deepspeed``'s JSON: no optimizer section (the script passes a torch AdamW) and no scheduler."""
    from zerobridge.testing.deepspeed_run import deepspeed_config

    return deepspeed_config(stage=stage, micro_batch=2, zero=PARITY_LAYOUTS[stage])


def load_parity(*, path: str, stage: int, save: str) -> dict[str, Any]:
    """On every rank: real DeepSpeed (client torch AdamW, as ``train_deepspeed`` builds it) loads ``path`` into a
    ``BufferedParityNet`` of other values; what it then holds, gathered, and the loss of one more step, after
    which it saves to ``save``."""
    import deepspeed
    import torch.distributed as dist

    from zerobridge.testing.deepspeed_run import BufferedParityNet, _full_optimizer_state, _full_params
    from zerobridge.testing.parity import batch, make_optimizer

    model = BufferedParityNet(seed=11)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=parity_config(stage))
    _, client_state = engine.load_checkpoint(path)
    found = {"params": _full_params(engine.module), "state": _full_optimizer_state(engine, engine.module),
             "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers() if n != "scratch"},
             "groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
             "client_state": {k: client_state[k] for k in ("epoch",)}, "global_steps": engine.global_steps}
    tokens, targets = batch(PARITY_STEPS, 0, 4)
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    loss = engine(tokens[mine], targets[mine])
    engine.backward(loss)
    engine.step()
    found["loss"] = float(loss.detach())
    engine.save_checkpoint(save, client_state={"epoch": 1})
    engine.destroy()
    return found


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_loads_frozen_tied_and_buffers(tmp_path: Path) -> None:
    """Every parameter (frozen, tied, unused), buffer, Adam moment and hyperparameter DeepSpeed holds after
    ``load_checkpoint`` is the exported one, bit for bit, at stages 1-3 (with round-robin order and parameter
    alignment padding, with ZeRO-3 sub-groups); one more step runs, and DeepSpeed's own save then has the
    export's files, keys, types, shapes and layout values."""
    pytest.importorskip("deepspeed")
    from zerobridge.harness.cluster import Cluster

    want = parity_source()
    source = write_portable(tmp_path / "source", want)
    with Cluster(2, timeout_s=300, env=ENV) as cluster:
        for stage in PARITY_LAYOUTS:
            path, _ = export_deepspeed_checkpoint(source, tmp_path / f"ds{stage}", stage=stage, world_size=2,
                                                  config=parity_config(stage))
            found = cluster.run(f"{ME}:load_parity", path=str(tmp_path / f"ds{stage}"), stage=stage,
                                save=str(tmp_path / f"own{stage}"))[0]
            assert isinstance(found, dict)
            for name, value in found["params"].items():  # frozen ones by their model value
                assert torch.equal(value, want.model[name].float()), (stage, name)
            assert set(found["params"]) | set(found["buffers"]) | {"head.weight"} == set(want.model)  # tied
            for name, value in found["buffers"].items():
                assert torch.equal(value, want.model[name]), (stage, name)
            assert set(found["state"]) == set(want.optimizer)
            for name, entries in found["state"].items():
                for key, value in entries.items():
                    assert torch.equal(value, want.optimizer[name][key]), (stage, name, key)
            assert [(g["lr"], g["weight_decay"], g["betas"]) for g in found["groups"]] == [
                (g["lr"], g["weight_decay"], g["betas"]) for g in want.param_groups]
            assert found["client_state"] == {"epoch": 1} and found["global_steps"] == PARITY_STEPS
            assert 0 < found["loss"] < 100  # finite: it trains on
            ours, own = _files(path), _files(tmp_path / f"own{stage}" / f"global_step{PARITY_STEPS + 1}")
            assert list(ours) == list(own)
            for file, skeleton_ in ours.items():
                assert skeleton_ == own[file], (stage, file)
            if stage == 2:  # the alignment padding is really there
                optim = torch.load(path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
                assert any(any(group) for group in optim["optimizer_state_dict"]["param_alignment_paddings"])


# ---------------------------------------------------------------------------- no process group from here on

TIED, FROZEN_IN_GROUP, FROZEN_ALONE = "head.weight", "frozen.weight", "extra.weight"
BUFFERS = ("norm.running_mean", "norm.num_batches_tracked")


def made_up(*, steps: int = 7) -> PortableState:
    """A checkpoint as zerobridge saves one: tied embedding/head, a frozen parameter listed in a group without
    state, one outside every group, two buffers, two param groups, sizes that need padding."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    embed = rand(11, 6)
    model = {"embed.weight": embed, "body.weight": rand(5, 6), "body.bias": rand(5), FROZEN_IN_GROUP: rand(3, 5),
             TIED: embed.clone(), FROZEN_ALONE: rand(7), BUFFERS[0]: rand(5), BUFFERS[1]: torch.tensor(4)}
    adamw = {"betas": (0.9, 0.99), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    groups = [{"lr": 0.02, "weight_decay": 0.1, **adamw, "params": ["embed.weight", "body.weight", FROZEN_IN_GROUP]},
              {"lr": 0.02, "weight_decay": 0.0, **adamw, "params": ["body.bias"]}]
    optimizer = {n: {"step": torch.tensor(float(steps)), "exp_avg": rand(*model[n].shape),
                     "exp_avg_sq": rand(*model[n].shape).abs()} for n in ("embed.weight", "body.weight", "body.bias")}
    return PortableState(model=model, optimizer=optimizer, param_groups=groups,
                         metadata={"deepspeed": {"global_steps": steps + 2, "global_samples": 8 * (steps + 2),
                                                 "skipped_steps": 2}},
                         scheduler={"last_epoch": steps + 2, "last_batch_iteration": steps + 1, "base_lrs": [0.02]},
                         client_state={"epoch": 2, "seen": [1, 2]})


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_portable(tmp_path_factory.mktemp("export") / "source", made_up())


def _zero_to_fp32() -> Any:
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils import zero_to_fp32
    except ImportError:
        return None
    return zero_to_fp32


def config(stage: int, **zero: Any) -> dict[str, Any]:
    return BASE | {"zero_optimization": {"stage": stage, **zero}}


@pytest.mark.parametrize(("stage", "world", "zero"), [
    (1, 1, {}), (1, 3, {"round_robin_gradients": True}), (2, 2, {}), (2, 3, {}),
    (2, 2, {"round_robin_gradients": True, "parameter_alignment": True}), (3, 1, {}), (3, 2, {}),
    (3, 3, {"sub_group_size": 5})])
def test_the_importer_reads_back_what_was_exported(source: Path, tmp_path: Path, stage: int, world: int,
                                                   zero: dict[str, Any]) -> None:
    path, report = export_deepspeed_checkpoint(source, tmp_path / "ds", stage=stage, world_size=world,
                                               config=config(stage, **zero), frozen=[FROZEN_ALONE])
    assert path == tmp_path / "ds" / "global_step9" and (tmp_path / "ds" / "latest").read_text() == "global_step9"
    back, _ = import_deepspeed_checkpoint(tmp_path / "ds")
    want = made_up()
    assert set(back.model) == set(want.model)
    for name, value in want.model.items():
        assert torch.equal(back.model[name].to(value.dtype), value), name
    assert back.model[TIED] is back.model["embed.weight"]  # written as DeepSpeed's shared_params
    for name, entries in want.optimizer.items():
        for key, value in entries.items():
            assert torch.equal(back.optimizer[name][key].float(), value.float()), (name, key)
    assert [g["params"] for g in back.param_groups] == [["embed.weight", "body.weight"], ["body.bias"]]
    assert [(g["lr"], tuple(g["betas"]), g["weight_decay"]) for g in back.param_groups] == [
        (0.02, (0.9, 0.99), 0.1), (0.02, (0.9, 0.99), 0.0)]
    assert back.scheduler == {"last_batch_iteration": 8}  # DeepSpeed's schedule takes only its position
    assert back.client_state == want.client_state
    assert back.metadata["deepspeed"] == want.metadata["deepspeed"]
    assert back.metadata["buffers"] == list(BUFFERS) and back.metadata["shared"] == {TIED: "embed.weight"}
    assert sorted(back.metadata["frozen"]) == sorted([FROZEN_IN_GROUP, FROZEN_ALONE])
    assert report.find("lr_scheduler").note == "last_batch_iteration 8"  # type: ignore[union-attr]
    if (zero_to_fp32 := _zero_to_fp32()) is not None:  # DeepSpeed's own reconstruction reads the files too
        fp32 = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
        lost = {FROZEN_IN_GROUP, FROZEN_ALONE} if stage == 1 else set()  # it reads only frozen_param_fragments
        assert set(fp32) == set(want.model) - lost
        for name, value in fp32.items():
            assert torch.equal(value.to(want.model[name].dtype), want.model[name]), name
    if zero.get("parameter_alignment"):  # the per-parameter padding really is there
        optim = torch.load(path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
        assert optim["optimizer_state_dict"]["param_alignment_paddings"] == [[2, 0], [0]]


def test_without_a_config_the_torch_form_is_written(source: Path, tmp_path: Path) -> None:
    """No JSON: DeepSpeed's defaults and a torch Adam/AdamW client optimizer: torch's groups and tensor steps,
    the scheduler state as saved."""
    path, _ = export_deepspeed_checkpoint(source, tmp_path, stage=2, world_size=2, tag="mine")
    optim = torch.load(path / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
    base = optim["optimizer_state_dict"]["base_optimizer_state"]
    assert torch.equal(base["state"][0]["step"], torch.tensor(7.0))
    assert base["param_groups"][0] == {k: v for k, v in made_up().param_groups[0].items() if k != "params"} | {
        "params": [0]}
    assert "clip_grad" not in optim["optimizer_state_dict"]  # the DeepSpeed run keeps its own clipping
    head = torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)
    assert head["lr_scheduler"] == made_up().scheduler and head["ds_config"] == {"zero_optimization": {"stage": 2}}
    assert (tmp_path / "latest").read_text() == "mine"


@pytest.mark.parametrize(("settings", "message"), [
    ({"fp16": {"enabled": True}}, "fp16 runs keep a dynamic loss scaler"),
    ({"bf16": {"enabled": True}}, "bf16 runs keep 16-bit module copies"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "DeepSpeedCPUAdam"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 0.01}}}, "optimizer type 'Lamb': only Adam and AdamW"),
    ({"zero_optimization": {"stage": 3}}, "the JSON says ZeRO stage 3 but --stage 2 was asked"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}}},
     "param group 0 ran AdamW weight decay but the JSON asks for Adam"),
])
def test_runs_it_cannot_write_for_are_refused(source: Path, tmp_path: Path, settings: dict[str, Any],
                                             message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as caught:
        export_deepspeed_checkpoint(source, tmp_path, stage=2, world_size=2, config=BASE | settings)
    assert "fix:" in str(caught.value)
    assert not any(tmp_path.iterdir())  # nothing written


def test_stage3_elastic_and_stage0_are_refused() -> None:
    with pytest.raises(CheckpointError, match="ZeRO-3 elastic checkpoints"):
        read_target(3, 2, config(3, elastic_checkpoint=True))
    with pytest.raises(CheckpointError, match="only stages 1-3 are written"):
        read_target(0, 2)


def _broken(kind: str) -> PortableState:
    state = made_up()
    if kind == "sgd":
        for entries in state.optimizer.values():
            entries["momentum_buffer"] = entries.pop("exp_avg")
    elif kind == "amsgrad":
        state.param_groups[1]["amsgrad"] = True
    elif kind == "steps":
        state.optimizer["body.bias"]["step"] = torch.tensor(3.0)
    elif kind == "client_state":
        state.client_state = {"module": 1, "epoch": 2}
    elif kind == "no_optimizer":
        state.optimizer, state.param_groups = {}, []
    return state


@pytest.mark.parametrize(("kind", "message"), [
    ("sgd", r"optimizer state holds \['momentum_buffer'\]: not Adam's"),
    ("amsgrad", "param group 1 runs Adam with amsgrad=True"),
    ("steps", "stepped different numbers of times"),
    ("client_state", r"client_state holds \['module'\]"),
    ("no_optimizer", "holds no optimizer state"),
])
def test_sources_it_cannot_write_are_refused(tmp_path: Path, kind: str, message: str) -> None:
    broken = write_portable(tmp_path / "source", _broken(kind))
    with pytest.raises(CheckpointError, match=message) as caught:
        export_deepspeed_checkpoint(broken, tmp_path / "ds", stage=3, world_size=2, config=config(3))
    assert str(broken) in str(caught.value) and "fix:" in str(caught.value)
    assert not (tmp_path / "ds").exists()


def test_outputs_it_will_not_overwrite(source: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is a zerobridge checkpoint"):
        export_deepspeed_checkpoint(source, source, stage=1, world_size=1)
    (tmp_path / "global_step9").mkdir()
    (tmp_path / "global_step9" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint tag directory"):
        export_deepspeed_checkpoint(source, tmp_path, stage=1, world_size=1)
    with pytest.raises(CheckpointError, match=r"frozen parameter\(s\) \['nope'\]"):
        export_deepspeed_checkpoint(source, tmp_path / "x", stage=1, world_size=1, frozen=["nope"])
    first, _ = export_deepspeed_checkpoint(source, tmp_path / "ds", stage=3, world_size=2)
    again, _ = export_deepspeed_checkpoint(source, tmp_path / "ds", stage=2, world_size=1)  # replaces the tag
    assert first == again and sorted(p.name for p in again.iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_command_line(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zerobridge.cli import main

    (tmp_path / "ds.json").write_text(json.dumps(config(3)), encoding="utf-8")
    assert main(["checkpoint", "export-deepspeed", str(source), str(tmp_path / "ds"), "--stage", "3",
                 "--world-size", "2", "--config", str(tmp_path / "ds.json"), "--frozen", FROZEN_ALONE]) == 0
    out = capsys.readouterr().out
    assert "lr_scheduler  exact" in out and f"wrote {tmp_path / 'ds' / 'global_step9'}" in out
    assert f"frozen ['{FROZEN_IN_GROUP}', '{FROZEN_ALONE}']" in out
    assert main(["checkpoint", "export-deepspeed", str(source), str(tmp_path / "ds"), "--stage", "3",
                 "--world-size", "2", "--tag", "t", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(tmp_path / "ds" / "t")
    assert main(["checkpoint", "export-deepspeed", str(source), str(tmp_path / "ds"), "--stage", "2",
                 "--world-size", "2", "--config", str(tmp_path / "ds.json")]) == 2
    assert "the JSON says ZeRO stage 3 but --stage 2 was asked" in capsys.readouterr().err
    assert main(["checkpoint", "export-deepspeed", str(tmp_path / "none"), str(tmp_path / "ds"), "--stage", "1",
                 "--world-size", "2"]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_exports_without_importing_deepspeed(source: Path, tmp_path: Path) -> None:
    code = ("import sys; from zerobridge.checkpoint.deepspeed_export import export_deepspeed_checkpoint; "
            f"export_deepspeed_checkpoint({str(source)!r}, {str(tmp_path)!r}, stage=3, world_size=2); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert sorted(p.name for p in (tmp_path / "global_step9").iterdir()) == [
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(2) for kind in ("model", "optim")]
