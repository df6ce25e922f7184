"""The DeepSpeed JSON the deepspeed backend runs a spec with, or the reason it cannot.

    >>> from zerobridge.spec.presets import spec_for_stage
    >>> from zerobridge.backends.deepspeed.config import build_config
    >>> plan = build_config(spec_for_stage(2), world_size=2)
    >>> plan.config["zero_optimization"]["stage"], plan.config["train_batch_size"], plan.accumulation_steps
    (2, 2, 1)

The spec goes through the same translator as ``zerobridge translate --to
deepspeed`` (``zerobridge.translate.deepspeed_write``); its report decides:

- entries that change only *when* or *in which pieces* DeepSpeed moves data
  (bucket sizes, prefetch timing, gather granularity: ``SCHEDULING``) and
  DeepSpeed's own checkpoint format (the backend writes zerobridge's) run
  as they are and are recorded;
- any other approximated, not expressible or ignored entry is refused with
  a ``ConfigError`` naming the spec key, unless ``allow_approximate``: then
  DeepSpeed's closest form runs and the entry is recorded.

What DeepSpeed needs and the spec leaves open is filled: the batch keys
(bookkeeping only, since the user's loop drives the steps), ``"per_unit"``
buckets sized to the model's largest wrap unit (``sizes``, which ``prepare``
counts: ``zerobridge.runtime.wrap_units.bucket_sizes``), ``"auto"`` sizes
(Hugging Face's rules from the hidden size), and
``zero_force_ds_cpu_optimizer: false`` so that optimizer offload runs the
user's torch optimizer. Torch-free: the launcher checks specs with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerobridge.errors import ConfigError
from zerobridge.spec import CompileScope, DType, StrategySpec, is_auto
from zerobridge.translate.carried import SECTIONS
from zerobridge.translate.deepspeed_buckets import BucketSizes
from zerobridge.translate.deepspeed_write import write_deepspeed
from zerobridge.translate.report import Entry, Report, Status

__all__ = ["SCHEDULING", "DeepSpeedPlan", "build_config", "launch_problems", "refusal"]

SCHEDULING = frozenset({
    "communication.reduce_bucket", "communication.allgather_bucket", "communication.prefetch_bucket",
    "communication.max_live_parameters", "offload.sub_group_size", "communication.backward_prefetch",
    "communication.max_inflight_gathers", "wrapping", "checkpoint.format",
})
"""Report keys whose approximation changes scheduling, gather granularity or
DeepSpeed's own checkpoint files, never the numbers trained: run and recorded."""

# "auto" sizes: (config key, factor, power of the hidden size), Hugging Face's rules.
_AUTO_SIZES = {"reduce_bucket_size": (1.0, 2), "allgather_bucket_size": (1.0, 2),
               "stage3_prefetch_bucket_size": (0.9, 2), "stage3_param_persistence_threshold": (10.0, 1)}


@dataclass
class DeepSpeedPlan:
    """A spec as DeepSpeed will run it."""

    spec: StrategySpec
    """The spec ``prepare`` resolved, as the user gave it."""
    config: dict[str, Any]
    """The JSON handed to ``deepspeed.initialize``."""
    report: Report
    """The translator's report."""
    accumulation_steps: int
    """Micro-batches per optimizer step (DeepSpeed's ``gradient_accumulation_steps``)."""
    clip: float | None
    """The spec's clipping at step time (``batch.clip_grad_norm``)."""
    approximations: list[Entry] = field(default_factory=list)
    """Entries that do not run exactly as the spec says: scheduling ones, and the
    approximations ``allow_approximate`` let through."""


def refusal(entries: list[Entry]) -> ConfigError:
    """The error for approximations run without ``allow_approximate``: the first, and the keys of the others."""
    entry = entries[0]
    more = f"; also not exact: {', '.join(e.key for e in entries[1:])}" if entries[1:] else ""
    return ConfigError(f"DeepSpeed cannot run this as the spec says ({entry.status.value}): {entry.note}{more}",
                       key=entry.key, fix="use backend='native', or pass allow_approximate=True to "
                                          "zerobridge.prepare to run DeepSpeed's closest form (recorded in "
                                          "zerobridge.stats(model)['approximations'])")


def _batch(spec: StrategySpec, config: dict[str, Any], world_size: int) -> int:
    micro = spec.batch.micro_batch_size if isinstance(spec.batch.micro_batch_size, int) else 1
    steps = spec.batch.accumulation_for(world_size)
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=steps,
                  train_batch_size=micro * steps * world_size)
    return steps


def _resolve_auto(config: dict[str, Any], hidden: int | None) -> None:
    """Replace every ``"auto"`` the translator kept with the value the native engine runs."""
    for section in ("fp16", "bf16"):  # auto precision: the engine computes in fp32
        if is_auto(config.get(section, {}).get("enabled")):
            config[section]["enabled"] = False
    zero = config["zero_optimization"]
    if is_auto(zero.get("stage3_gather_16bit_weights_on_model_save")):
        zero["stage3_gather_16bit_weights_on_model_save"] = False  # the backend writes zerobridge checkpoints
    for key, (factor, power) in _AUTO_SIZES.items():
        if is_auto(zero.get(key)):
            if hidden is None:
                raise ConfigError(f"zero_optimization.{key} is 'auto' and the model has no config.hidden_size",
                                  key=f"communication.{key}", fix="give the size as a number of elements")
            zero[key] = int(factor * hidden**power)
    if is_auto(config.get("gradient_clipping")):
        config["gradient_clipping"] = 0.0
    left = [k for k, v in _walk(config) if is_auto(v)]
    if left:
        raise ConfigError(f"{left[0]} is still 'auto' for DeepSpeed", key=left[0],
                          fix="give it a value in the spec (nothing fills it without a trainer)")


def _walk(node: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out += _walk(value, path + ".") if isinstance(value, dict) else [(path, value)]
    return out


def build_config(spec: StrategySpec, *, world_size: int, allow_approximate: bool = False,
                 hidden: int | None = None, accelerator: str = "cpu",
                 sizes: BucketSizes | None = None) -> DeepSpeedPlan:
    """The DeepSpeed config that runs ``spec`` on ``world_size`` ranks; ``ConfigError``
    when DeepSpeed cannot run it exactly (unless ``allow_approximate``) or at all. ``sizes``:
    the buckets for the model, where the spec leaves them to the engine."""
    if spec.precision.param_dtype == DType.FP16:
        where = "on CPU DeepSpeed refuses fp16 (no fp16 optimizer without an accelerator)" if accelerator == "cpu" \
            else "fp16 needs DeepSpeed's loss scaling inside engine.backward, which the plain loss.backward() " \
                 "loop of this backend does not apply"
        raise ConfigError(f"precision.param_dtype='fp16' cannot run on the deepspeed backend: {where}",
                          key="precision.param_dtype", fix="use param_dtype='bf16', or backend='native'")
    if spec.communication.wire.quantized and accelerator == "cpu":
        raise ConfigError("communication.wire quantizes collectives, and DeepSpeed's ZeRO++ quantizer kernels are "
                          "CUDA-only (on CPU CUDAQuantizer raises 'This op had not been implemented on CPU backend')",
                          key="communication.wire", fix="use backend='native', which quantizes on any device "
                                                        "(docs/quantized.md), or run on a GPU")
    spec.sharding.check_world(world_size)
    translation = write_deepspeed(spec, sizes)
    config: dict[str, Any] = translation.value
    for section in SECTIONS:  # the script's to build (zerobridge.deepspeed.initialize does): never behind its back
        config.pop(section, None)
    # sharding.world_size: checked above (DeepSpeed takes the world from the launcher, which matches).
    # compile: the JSON cannot say it; the backend calls engine.compile itself (``compile_entries``).
    approximations = [e for e in translation.report.approximations
                      if e.key != "sharding.world_size" and not _is_compile(e.key)] + compile_entries(spec)
    blocking = [e for e in approximations if e.key not in SCHEDULING]
    if blocking and not allow_approximate:
        raise refusal(blocking)
    steps = _batch(spec, config, world_size)
    _resolve_auto(config, hidden)
    config.update(zero_allow_untested_optimizer=True, steps_per_print=2**62, wall_clock_breakdown=False)
    if "offload_optimizer" in config["zero_optimization"]:
        config["zero_force_ds_cpu_optimizer"] = False  # run the user's optimizer on the offloaded state
    clip = config["gradient_clipping"]
    return DeepSpeedPlan(spec=spec, config=config, report=translation.report, accumulation_steps=steps,
                         clip=float(clip) if clip else None, approximations=approximations)


def _is_compile(key: str) -> bool:
    return key == "compile" or key.startswith("compile.")


def compile_entries(spec: StrategySpec) -> list[Entry]:
    """How DeepSpeed's own compile path (``engine.compile``: the whole module, its engine hooks
    inside the compiled call) differs from the spec's."""
    entries = []
    if spec.compile.enabled and spec.compile.fullgraph:
        entries.append(Entry("compile.fullgraph", Status.APPROXIMATED,
                             "DeepSpeed's forward hooks (timers, ZeRO-3 gathers) run inside the compiled call "
                             "and break its graph: compiled with fullgraph=False"))
    if spec.compile.enabled and spec.compile.scope is CompileScope.UNITS and spec.sharding.parameters.sharded_at_rest:
        entries.append(Entry("compile.scope", Status.APPROXIMATED,
                             "DeepSpeed compiles the whole module (engine.compile), not unit by unit; at stage 3 "
                             "its graphs end at the gather hooks DeepSpeed puts on every submodule"))
    return entries


def launch_problems(spec: StrategySpec, *, world_size: int | None) -> tuple[ConfigError | None, list[Entry]]:
    """For ``zerobridge run --backend deepspeed``: the error no ``prepare`` argument can
    avoid (``None`` when there is none), and the approximations ``prepare`` refuses
    unless the script passes ``allow_approximate=True``. ``world_size``: ``None``
    when the launcher cannot tell (the checks that need it are skipped)."""
    try:
        plan = build_config(spec, world_size=world_size or 1, allow_approximate=True, hidden=1,
                            accelerator="unknown")
    except ConfigError as exc:
        unknown_world = world_size is None and exc.key in ("sharding.world_size", "batch.global_batch_size")
        if unknown_world:
            return None, []
        return exc, []
    return None, [e for e in plan.approximations if e.key not in SCHEDULING]
