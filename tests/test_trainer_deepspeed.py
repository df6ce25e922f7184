"""The real client: Hugging Face Trainer at world 2 under a DeepSpeed JSON zerobridge wrote, against plain DDP.

Each source goes through ``load_spec -> with_run_settings(precision="fp32") -> write(spec, "deepspeed")``
(``zerobridge convert SRC --to deepspeed --precision fp32``). Then
``python -m torch.distributed.run --nproc-per-node 2 -m zerobridge.testing.trainer_run`` trains a tiny
fp32 Llama for ``STEPS`` optimizer steps (gloo on CPU) twice with the same flags: once plain DDP, once
with ``--deepspeed written.json``. The flags are ``COMMON`` plus what zerobridge tells a Trainer user to
pass: the run-level values the spec states (``trainer_run_flags``; torchtitan states its own batch and
clipping) and the optimizer/scheduler flags (``trainer_form_of(spec).flags``), as ``convert
--trainer-args`` prints them. Per-step losses must agree within ``LOSS_RTOL`` and grad norms within
``GRAD_NORM_RTOL`` (relative); fp32 runs agree to ~1e-7, and a gradient all-reduce in bf16 already
moves the loss by 1.1e-5. Stage 0 would log no grad norm (its plain torch optimizer records none, see
``zerobridge.testing.trainer_run``): no source here is stage 0.

Schedulers. A JSON's ``scheduler`` section makes DeepSpeed build its own scheduler (``WarmupLR`` etc.),
which runs behind Trainer's (it starts at ``warmup_min_lr`` for two steps, clamps the warmup to >= 2
steps, warms up logarithmically by default: ``trainer_args`` reports it approximated). So the DDP
reference of such a source runs DeepSpeed's own scheduler class from the same section, filled from the
same flags (``--deepspeed-schedule``), and both runs must show the same lr at every step: the comparison
then holds the optimizer, ZeRO stage, offload, batch, accumulation, clipping and precision to DeepSpeed's
numbers, and the schedule to DeepSpeed's own. Trainer's acceptance of the scheduler flags is
``tests/test_trainer_config.py``'s.

Offload. A JSON without an ``optimizer`` section under ZeRO-Offload gets Trainer's ``torch.optim.AdamW``,
which Accelerate swaps for a ``DeepSpeedCPUAdam`` over the same param groups (same lr, betas, eps, weight
decay) because the JSON leaves ``zero_force_ds_cpu_optimizer`` at its default, true. With it false, Trainer's
torch AdamW runs as is (checked by hand: loss deviation 0, grad norm 7e-8); the test does not set it and runs
the JSON as written, so DeepSpeed's C++ CPU Adam (and, for an ``optimizer`` section without offload, its CPU
FusedAdam) is JIT-built once into ``$TORCH_EXTENSIONS_DIR`` (about 2 minutes the first time, then cached).

Cost: one launch of ``trainer_run --jobs`` for the module (``Runs``): every distinct (written JSON, flags)
and every distinct DDP (flags, schedule) runs once, one after another in the same process group, so the
imports and the rendezvous (about 10 s of each launch on 2 CPU cores) are paid once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, corpus_dir, in_original_layout

from zerobridge.backends.deepspeed.extensions import build_ops
from zerobridge.load import load_spec
from zerobridge.spec import StrategySpec
from zerobridge.translate.formats import write
from zerobridge.translate.run_level import trainer_run_flags, with_run_settings
from zerobridge.translate.sources import parse_json, read_text
from zerobridge.translate.trainer_args import trainer_form_of

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

WORLD = 2
STEPS = 4
COMMON: tuple[str, ...] = (
    "--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
    "--max_grad_norm", "1.0", "--learning_rate", "1e-3", "--optim", "adamw_torch",
)
"""Flags of every run (``trainer_run.DEFAULTS`` add CPU, no reporting, no saving, seed 0, sequential data).
``--optim adamw_torch`` (Trainer's default is ``adamw_torch_fused``) is what ``trainer_form_of`` names for a
DeepSpeed Adam(W) section: stated for every run, sources with and without a section share a DDP reference."""
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
LAUNCH_TIMEOUT_S = 600  # the first DeepSpeed launch JIT-builds DeepSpeed's shm comm op (~40 s)

FSDP_KWARGS = {"sharding_strategy": "SHARD_GRAD_OP"}

@dataclass(frozen=True)
class Source:
    """A config ``zerobridge convert`` reads: a registry name, a corpus file (``kind/name``) or an FSDP kwargs JSON."""

    id: str
    name: str
    kind: str = "registry"

    def path(self, root: Path) -> str | Path:
        """What ``load_spec`` gets: the registry name, or a file (an Accelerate YAML in its repository layout)."""
        if self.kind == "registry":
            return self.name
        if self.kind == "fsdp-kwargs":
            path = root / "fsdp_kwargs.json"
            path.write_text(json.dumps(FSDP_KWARGS), encoding="utf-8")
            return path
        corpus = corpus_dir()
        if corpus is None:
            pytest.skip("no ../shared/corpus (set ZEROBRIDGE_CORPUS)")
        return in_original_layout(corpus / self.kind / self.name, root / "layout")


def _corpus(id_: str, kind: str, name: str, *marks: Any) -> Any:
    return pytest.param(Source(id_, name, kind), marks=[pytest.mark.corpus, *marks], id=id_)


SOURCES = [
    _corpus("accelerate-fsdp-alignment-handbook", "accelerate",
            "huggingface__alignment-handbook__recipes__accelerate_configs__fsdp.yaml"),
    _corpus("accelerate-fsdp2-llama-factory", "accelerate",
            "hiyouga__LLaMA-Factory__examples__accelerate__fsdp2_config.yaml"),
    _corpus("accelerate-fsdp-offload-llama-factory", "accelerate",
            "hiyouga__LLaMA-Factory__examples__accelerate__fsdp_config_offload.yaml"),
    pytest.param(Source("fsdp-kwargs-shard-grad-op", "fsdp_kwargs.json", "fsdp-kwargs"),
                 id="fsdp-kwargs-shard-grad-op"),
    _corpus("torchtitan-debug-model", "torchtitan",
            "pytorch__torchtitan__torchtitan__models__llama3__train_configs__debug_model.toml"),
    *(pytest.param(Source(name, name), id=name) for name in ("zero1", "zero2", "zero3", "zero2-offload")),
    _corpus("ds-hf-zero2", "deepspeed", "huggingface__transformers__tests__deepspeed__ds_config_zero2.json"),
    _corpus("ds-hf-zero2-bf16", "deepspeed", "huggingface__transformers__tests__deepspeed__ds_config_zero2_bf16.json"),
    _corpus("ds-hf-zero3", "deepspeed", "huggingface__transformers__tests__deepspeed__ds_config_zero3.json"),
    _corpus("ds-axolotl-zero1", "deepspeed", "axolotl-ai-cloud__axolotl__deepspeed_configs__zero1.json"),
    _corpus("ds-accelerate-zero2-fp16", "deepspeed",
            "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage2_config.json"),
]


# --------------------------------------------------------------------------------------------- helpers


def trainer_flags(spec: StrategySpec) -> tuple[str, ...]:
    """``COMMON`` then zerobridge's flags for ``spec`` (``convert --trainer-args``), which win where they overlap."""
    return (*COMMON, *trainer_run_flags(spec), *trainer_form_of(spec).flags)


def flag_key(flags: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``flags`` as the parser sees them (a later flag replaces an earlier one), to share runs across sources."""
    seen: dict[str, str] = {}
    i = 0
    while i < len(flags):
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        seen[flags[i]] = flags[i + 1] if has_value else "true"
        i += 2 if has_value else 1
    return tuple(sorted(seen.items()))


def below_fp32(ds: dict[str, Any]) -> list[str]:
    """Keys of a JSON written for ``--precision fp32`` that compute, reduce or accumulate in a lower precision."""
    found = [f"{key}.enabled={ds[key]['enabled']!r}" for key in ("bf16", "fp16")
             if isinstance(ds.get(key), dict) and ds[key].get("enabled") not in (False, None)]
    if ds.get("communication_data_type") not in (None, "fp32"):
        found.append(f"communication_data_type={ds['communication_data_type']!r}")
    accumulate = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if accumulate not in (None, "fp32"):
        found.append(f"data_types.grad_accum_dtype={accumulate!r}")
    return found


def needs_cpp_adam(ds: dict[str, Any]) -> bool:
    """Whether DeepSpeed (or Accelerate) builds a C++ Adam for this JSON: an optimizer section that is not
    ``torch_adam``, or ZeRO-Offload of the optimizer (DeepSpeedCPUAdam)."""
    params = (ds.get("optimizer") or {}).get("params") or {}
    offload = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return ("optimizer" in ds and not params.get("torch_adam")) or offload != "none"


def cpp_adam_missing() -> str:
    """Build (or load from ``$TORCH_EXTENSIONS_DIR``) DeepSpeed's CPU Adam ops once, before the ranks need them
    (``zerobridge build-ops``, as ``make ops`` does ahead of the suite); the reason when DeepSpeed cannot build
    them here, else ``""``."""
    failed = [b for b in build_ops(["cpu_adam", "fused_adam"]) if b.error]
    return f"DeepSpeed cannot build its {failed[0].name} here: {failed[0].error}" if failed else ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Case:
    """One source's pair of runs: the DeepSpeed JSON written for it, its flags, and its DDP reference."""

    ds: dict[str, Any]
    flags: tuple[str, ...]
    skip: str | None = None
    failure: str | None = None
    """Why converting the source failed (the test fails with it)."""

    @property
    def deepspeed_key(self) -> Any:
        return ("deepspeed", flag_key(self.flags), json.dumps(self.ds, sort_keys=True))

    @property
    def ddp_key(self) -> Any:
        return ("ddp", flag_key(self.flags), json.dumps(self.ds.get("scheduler"), sort_keys=True))


def case_of(source: Source, root: Path) -> Case:
    """``source`` converted as the test's docstring says: the JSON and the flags a Trainer user is told to use."""
    path = source.path(root)
    spec = with_run_settings(load_spec(path).value, precision="fp32").value
    ds = write(spec, "deepspeed").value
    assert below_fp32(ds) == [], f"written for --precision fp32, yet {below_fp32(ds)}"
    if source.kind == "deepspeed":  # carried verbatim: the DDP reference takes its schedule from the output
        original = parse_json(read_text(Path(path)), source.name).data
        assert {k: ds.get(k) for k in ("optimizer", "scheduler")} == {
            k: original.get(k) for k in ("optimizer", "scheduler")}
    return Case(ds, trainer_flags(spec))


class Runs:
    """Every source's DeepSpeed run and DDP reference, in one launch of ``trainer_run --jobs`` at world 2.

    Runs shared between sources (same flags, same JSON, or the same DDP reference) are launched once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cases: dict[str, Case] = {}
        self.results: dict[Any, dict[str, Any]] = {}
        self.env = os.environ | {
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }

    def prepare(self, sources: list[Source]) -> None:
        """Convert every source that can run here, then launch all their runs once."""
        cpp_adam: str | None = None
        jobs: dict[Any, list[str]] = {}
        for source in sources:
            folder = self.root / source.id
            folder.mkdir()
            try:
                case = case_of(source, folder)
            except pytest.skip.Exception as skipped:
                self.cases[source.id] = Case({}, (), skip=str(skipped))
                continue
            except Exception:  # this source's test fails with it; the others still run
                self.cases[source.id] = Case({}, (), failure=traceback.format_exc())
                continue
            if needs_cpp_adam(case.ds):
                cpp_adam = cpp_adam if cpp_adam is not None else cpp_adam_missing()
                if cpp_adam:
                    self.cases[source.id] = Case(case.ds, case.flags, skip=cpp_adam)
                    continue
            self.cases[source.id] = case
            for key, extra in ((case.deepspeed_key, self._deepspeed_flags(case)),
                               (case.ddp_key, self._ddp_flags(case))):
                if key not in jobs:
                    out = self.root / f"run{len(jobs)}" / "steps.json"
                    jobs[key] = ["--output_dir", str(out.parent), *case.flags, *extra, "--steps-out", str(out)]
        if jobs:
            self._launch(jobs)

    def _deepspeed_flags(self, case: Case) -> tuple[str, ...]:
        path = self.root / f"ds{abs(hash(case.deepspeed_key))}.json"
        path.write_text(json.dumps(case.ds, sort_keys=True, indent=1), encoding="utf-8")
        return ("--deepspeed", str(path))

    def _ddp_flags(self, case: Case) -> tuple[str, ...]:
        scheduler = case.ds.get("scheduler")
        if scheduler is None:
            return ()
        path = self.root / f"schedule{abs(hash(case.ddp_key))}.json"
        path.write_text(json.dumps({"scheduler": scheduler}), encoding="utf-8")
        return ("--deepspeed-schedule", str(path))

    def _launch(self, jobs: dict[Any, list[str]]) -> None:
        """One torchrun of ``trainer_run --jobs``; each job's record (or its error) lands in ``results``."""
        listing = self.root / "jobs.json"
        listing.write_text(json.dumps(list(jobs.values()), indent=1), encoding="utf-8")
        for attempt in (1, 2):  # the port picked here may be taken before torchrun binds it
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                   "-m", "zerobridge.testing.trainer_run", "--jobs", str(listing)]
            proc = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True,
                                  timeout=LAUNCH_TIMEOUT_S)
            if proc.returncode == 0 or attempt == 2 or "address already in use" not in proc.stderr.lower():
                break
        (self.root / "stdout.log").write_text(proc.stdout, encoding="utf-8")
        (self.root / "stderr.log").write_text(proc.stderr, encoding="utf-8")
        for key, argv in jobs.items():
            out = Path(argv[argv.index("--steps-out") + 1])
            if out.exists():
                self.results[key] = json.loads(out.read_text(encoding="utf-8"))
            else:
                self.results[key] = {"error": f"{' '.join(cmd)} exited {proc.returncode} before this job wrote "
                                              f"{out} (logs in {self.root}):\n{_errors(proc.stderr)}"}

    def pair(self, source: Source) -> tuple[Case, dict[str, Any], dict[str, Any]]:
        """``source``'s case, DeepSpeed record and DDP record; skips where it could not run here."""
        case = self.cases[source.id]
        if case.skip:
            pytest.skip(case.skip)
        assert case.failure is None, case.failure
        records = self.results[case.deepspeed_key], self.results[case.ddp_key]
        for record in records:
            assert "error" not in record, record["error"]
        return case, *records


def _errors(log: str) -> str:
    """The lines of a failed launch's stderr worth reading: tracebacks and errors, not the warnings."""
    keep = [line for line in log.splitlines()
            if not line.startswith(("  return func(", "  warnings.warn(")) and "Warning" not in line]
    return "\n".join(keep[-120:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("trainer_runs"))
    runs.prepare([param.values[0] for param in SOURCES])
    return runs


def _deviation(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def compare(ddp: list[dict[str, Any]], ds: list[dict[str, Any]], stage: int) -> tuple[float, float | None]:
    """Max relative (loss, grad norm) deviation of ``ds`` from ``ddp``, asserting they are within tolerance."""
    assert [s["step"] for s in ddp] == [s["step"] for s in ds] == list(range(1, STEPS + 1))
    for a, b in zip(ddp, ds):
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9, abs=1e-15), f"step {a['step']}: lr {b['lr']} vs {a['lr']}"
    loss = max(_deviation(a["loss"], b["loss"]) for a, b in zip(ddp, ds))
    assert loss <= LOSS_RTOL, f"losses {[s['loss'] for s in ds]} vs DDP {[s['loss'] for s in ddp]}"
    if stage == 0 and all(s["grad_norm"] is None for s in ds):
        return loss, None  # stage 0's plain torch optimizer records no norm: losses only
    assert all(s["grad_norm"] is not None for s in ddp + ds)
    norm = max(_deviation(a["grad_norm"], b["grad_norm"]) for a, b in zip(ddp, ds))
    assert norm <= GRAD_NORM_RTOL, f"grad norms {[s['grad_norm'] for s in ds]} vs DDP {[s['grad_norm'] for s in ddp]}"
    return loss, norm


# ----------------------------------------------------------------------------------------------- tests


def test_deepspeed_builds_its_cpu_adam_here() -> None:
    """DeepSpeed's CPU Adam and FusedAdam (the offload sources' and the optimizer sections' optimizers) build
    or load from ``$TORCH_EXTENSIONS_DIR``. ``make test`` compiles them beside the lint (``make ops``), so here
    they load; run alone on a fresh clone, this is their compile (about a minute on 2 cores), a cost of its
    own rather than part of the first source's runs."""
    pytest.importorskip("deepspeed")
    missing = cpp_adam_missing()
    if missing:
        pytest.skip(missing)


@pytest.mark.parametrize("source", SOURCES)
def test_deepspeed_run_matches_ddp(source: Source, runs: Runs, record_property: Any) -> None:
    case, deepspeed_run, reference = runs.pair(source)
    stage = case.ds["zero_optimization"]["stage"]
    # What trained: guards against a comparison of DDP with itself.
    assert deepspeed_run["engine"] | {"optimizer": None} == {"deepspeed": True, "zero_stage": stage,
                                                             "optimizer": None, "world_size": WORLD}
    assert reference["engine"]["deepspeed"] is False and reference["engine"]["world_size"] == WORLD
    loss, norm = compare(reference["steps"], deepspeed_run["steps"], stage)
    record_property("max_loss_deviation", loss)
    record_property("max_grad_norm_deviation", norm)
    print(f"\n{source.id}: stage {stage}, {deepspeed_run['engine']['optimizer']} vs DDP "
          f"{reference['engine']['optimizer']}: max relative deviation loss {loss:.2e}, "
          f"grad norm {'n/a' if norm is None else f'{norm:.2e}'}")
