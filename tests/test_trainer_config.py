"""Hugging Face Trainer's own check accepts every DeepSpeed JSON zerobridge writes.

For every corpus source (DeepSpeed JSON, Accelerate YAML, torchtitan TOML) and
every registry entry, the written JSON goes through what ``Trainer`` does with
``--deepspeed``: ``HfTrainerDeepSpeedConfig.trainer_config_process(args)``
(fills ``"auto"`` from ``TrainingArguments``, collects mismatches), Accelerate's
``DeepSpeedPlugin(hf_ds_config=...)`` (which ``TrainingArguments`` builds next:
it fills its own keys, ``stage3_gather_16bit_weights_on_model_save``, and sets
a missing ``gradient_accumulation_steps`` to 1), and
``trainer_config_finalize(args, model, num_training_steps)`` (fills the
hidden-size and scheduler keys, raises ``ValueError`` listing every mismatch).
The arguments are what zerobridge tells a user to pass: the run-level values
the spec states (``trainer_run_flags``, as ``convert --trainer-args`` prints
them) and the optimizer/scheduler flags (``trainer_form_of(spec).flags``),
at world size 1 (where a stated global batch implies the micro batch or
accumulation) and ``--bf16``/``--fp16`` where the JSON
enables them literally. The finalized config must then hold no ``"auto"`` and pass
``deepspeed.runtime.config.DeepSpeedConfig`` at world size 1 (without a
process group DeepSpeedConfig falls back to rank 0 of 1, as
``test_deepspeed_validates.py`` relies on). No process group, no training.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import corpus_files, in_original_layout

from zerobridge.load import load_spec
from zerobridge.registry import strategies
from zerobridge.spec import StrategySpec
from zerobridge.translate.formats import write
from zerobridge.translate.run_level import trainer_run_flags, with_run_settings
from zerobridge.translate.sources import parse_json, read_text
from zerobridge.translate.trainer_args import trainer_form_of

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("transformers")
deepspeed_config = pytest.importorskip("deepspeed.runtime.config")

STEPS = 10
"""``num_training_steps`` handed to ``trainer_config_finalize`` (fills ``scheduler.params.total_num_steps``)."""

BASE_FLAGS: tuple[str, ...] = ("--use_cpu", "true", "--report_to", "none", "--per_device_train_batch_size", "2")
"""What every run passes before zerobridge's flags (which win where they name the same flag)."""


# --------------------------------------------------------------------------------------------- helpers


def autos(node: Any, path: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` left in a config."""
    if isinstance(node, dict):
        return [hit for key, value in node.items() for hit in autos(value, f"{path}.{key}" if path else str(key))]
    if isinstance(node, list):
        return [hit for i, value in enumerate(node) for hit in autos(value, f"{path}[{i}]")]
    return [path] if node == "auto" else []


def precision_flags(ds: dict[str, Any]) -> list[str]:
    """``--bf16`` / ``--fp16`` where the JSON enables them literally (``True``, not ``"auto"``)."""
    flags = []
    for key in ("bf16", "fp16"):
        section = ds.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            flags.append(f"--{key}")
    return flags


def trainer_flags(spec: StrategySpec, ds: dict[str, Any]) -> list[str]:
    """The flags a Trainer command line gets for ``spec`` at world 1: the run-level values the spec states and the
    optimizer/scheduler flags (what ``convert --trainer-args --world-size 1`` prints), and ``--bf16``/``--fp16``
    where the JSON enables them literally."""
    # at world 1 a stated global batch implies the missing factor (hybrid groups need more ranks: none stated)
    at_one = with_run_settings(spec, world_size=1).value if isinstance(spec.batch.global_batch_size, int) else spec
    flags = [*trainer_run_flags(at_one), *trainer_form_of(spec).flags]
    return flags + [flag for flag in precision_flags(ds) if flag not in flags]


def training_args(flags: list[str], output_dir: Path) -> Any:
    """``TrainingArguments`` parsed from ``BASE_FLAGS + flags`` as a Trainer script's command line would be."""
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(output_dir), *BASE_FLAGS, *flags])
    return args


@pytest.fixture(scope="module")
def model() -> Any:
    """A tiny Llama: ``trainer_config_finalize`` reads ``model.config.hidden_size`` for the hidden-size "auto" keys."""
    from zerobridge.testing.trainer_run import tiny_llama

    return tiny_llama()


def trainer_check(ds: dict[str, Any], args: Any, model: Any, *, strict: bool = True) -> dict[str, Any]:
    """What Trainer does with ``--deepspeed``: fill and check; the finalized config. Raises ``ValueError``
    listing the mismatches unless ``strict`` is false (then the config as filled, to ask DeepSpeed about it)."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(ds))
    try:
        hf.trainer_config_process(args)  # TrainingArguments.__post_init__ with --deepspeed ...
        DeepSpeedPlugin(hf_ds_config=hf)  # ... then fills the plugin's own "auto" keys (ZeRO-3 16-bit save)
        try:
            hf.trainer_config_finalize(args, model, STEPS)  # deepspeed_init, once the model and step count exist
        except ValueError:
            if strict:
                raise
    finally:
        unset_hf_deepspeed_config()  # no ZeRO-3 weakref leaks into other tests' from_pretrained
    return hf.config


def source_json(path: Path) -> Path | None:
    """The DeepSpeed JSON a corpus source is or names (an Accelerate YAML's deepspeed_config_file), if any."""
    if path.suffix == ".json":
        return path
    if path.suffix in (".yaml", ".yml"):
        ref = ((yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("deepspeed_config") or {}).get(
            "deepspeed_config_file")
        return (path.parent / ref).resolve() if ref else None
    return None


def deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


def check_source(source: str | Path, tmp_path: Path, model: Any, original: Path | None = None) -> dict[str, Any]:
    """Write ``source`` as DeepSpeed JSON and run Trainer's check and DeepSpeed's on it; the finalized config."""
    spec = load_spec(source).value
    ds = write(spec, "deepspeed").value
    args = training_args(trainer_flags(spec, ds), tmp_path / "out")
    config = trainer_check(ds, args, model)  # ValueError "...mismatch TrainingArguments values" fails the test
    assert "train_micro_batch_size_per_gpu" in config or "train_batch_size" in config, config
    assert autos(config) == [], f"Trainer leaves 'auto' in {autos(config)}"
    try:
        checked = deepspeed_config.DeepSpeedConfig(config, mpu=None)
    except Exception as ours:
        # Allowed only where the source itself is refused on the same path (Trainer's fill, Accelerate's
        # plugin, DeepSpeedConfig): never a refusal zerobridge introduced.
        if original is None:
            raise
        first = lambda exc: " ".join(line.strip() for line in str(exc).splitlines()[:2])
        try:
            deepspeed_config.DeepSpeedConfig(trainer_check(
                dict(parse_json(read_text(original), str(original)).data), args, model, strict=False), mpu=None)
        except Exception as theirs:
            pytest.skip(f"DeepSpeed {deepspeed_version()} refuses it ({first(ours)}), and the source itself, "
                        f"filled as Trainer fills it ({first(theirs)})")
        pytest.fail(f"the source passes, zerobridge's output is refused: {first(ours)}")
    assert checked.world_size == 1
    assert checked.train_batch_size == (checked.train_micro_batch_size_per_gpu * checked.gradient_accumulation_steps)
    assert checked.train_micro_batch_size_per_gpu == args.per_device_train_batch_size
    assert checked.gradient_accumulation_steps == args.gradient_accumulation_steps
    assert checked.gradient_clipping == args.max_grad_norm
    return config


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", [s.name for s in strategies()])
def test_registry_entry_passes_trainers_check(name: str, tmp_path: Path, model: Any) -> None:
    config = check_source(name, tmp_path, model)
    assert config["gradient_clipping"] == 1.0  # left to Trainer: its default --max_grad_norm filled it


@pytest.mark.corpus
@pytest.mark.parametrize("path", [*corpus_files("deepspeed"), *corpus_files("accelerate"),
                                  *corpus_files("torchtitan")], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_source_passes_trainers_check(path: Path, tmp_path: Path, model: Any) -> None:
    located = in_original_layout(path, tmp_path / "layout")
    check_source(located, tmp_path, model, original=source_json(located))


def test_clipping_zero_is_refused_against_default_args(tmp_path: Path, model: Any) -> None:
    """The check can fail: a JSON that states no clipping where Trainer clips at 1.0 is a mismatch
    (what zerobridge wrote before it left clipping to Trainer)."""
    spec = load_spec("zero2").value
    ds = write(spec, "deepspeed").value | {"gradient_clipping": 0.0}
    args = training_args([], tmp_path / "out")
    with pytest.raises(ValueError, match=r"gradient_clipping=0\.0 vs hf max_grad_norm=1\.0"):
        trainer_check(ds, args, model)
