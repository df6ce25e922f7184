"""DeepSpeed's buckets for a spec that leaves them to the engine, and the memory each one costs.

    >>> from zerobridge.spec import DType
    >>> from zerobridge.translate.deepspeed_buckets import BucketSizes, reduce_buffers
    >>> sizes = BucketSizes.for_unit(1_181_185, unit="model.layers.0")
    >>> sizes.reduce, sizes.allgather, sizes.prefetch
    (1181186, 1181186, 1181186)
    >>> BucketSizes.for_unit(1_181_185, unit="model.layers.0", hidden=256).reduce   # hidden_size^2
    65536
    >>> reduce_buffers(500_000_000, stage=2, overlap=True, dtype=DType.FP32)
    'DeepSpeed preallocates 2 x reduce_bucket_size elements with overlap_comm: 3.73 GiB in fp32'

FSDP, Accelerate, Lightning and torchtitan gather and reduce one wrap unit at
a time (the spec's ``"per_unit"``): their transient buffers hold one unit's
parameters or gradients. DeepSpeed sizes the same buffers by element counts
(``zero_optimization``): at stages 1-2 it preallocates ``reduce_bucket_size``
elements for gradient reduction, twice with ``overlap_comm``; at stage 3 one
flat reduce bucket of that size; at stage 3 it gathers up to
``stage3_prefetch_bucket_size`` parameter elements ahead of use. Its defaults
(5e8 and 5e7 elements) are sized for billion-parameter layers: written for a
small model they cost gigabytes the source flavor never holds.

``BucketSizes`` sizes the all-gather and prefetch buckets to the largest wrap
unit's parameter count, so that a bucket holds what one of the source's
collectives holds. The reduce bucket is the one DeepSpeed preallocates and
holds through every backward (twice at stages 1-2 with ``overlap_comm``; from
setup on at stage 3), where the source holds a unit's gradients only while it
reduces them: sized to a unit it is the largest term of DeepSpeed's backward
(tiny Llama, ZeRO-2 fp32, world 2: 129.5 MiB against 100.7 MiB at
hidden_size^2, the native engine's 85.8 MiB). Where the model states a hidden
size it is ``hidden_size^2`` elements, what HF Trainer and Accelerate fill
``"auto"`` with (so a config written with the model and one written as
``"auto"`` and filled by Trainer are the same run); a gradient larger than the
bucket is reduced from its own tensor, not copied into it. Without a hidden
size it is the largest unit's count. At
stage 3 it bounds the gathered parameters the same way
(``stage3_max_live_parameters``, where the spec sets no bound): FSDP frees a
unit after use and prefetches one, while DeepSpeed without a bound keeps
prefetching as far as the prefetch bucket reaches. And it steps the optimizer
in sub-groups of the largest unit's partition (``sub_group_size``, where the
spec keeps the default), so that the step's working set is a unit's, as
FSDP's per-parameter step is, not the whole partition's.
A bucket the spec states is kept, unless the model is known and the bucket is
larger than the whole model: the reduce bucket is then written at the model's
size (the same reductions, without preallocating elements no gradient fills).
``bucket_value`` decides what the DeepSpeed writer writes for one bucket and
reports it, with its cost (``bucket_cost``).
Counts are rounded up to even: DeepSpeed asserts that
``allgather_bucket_size`` is a multiple of 2. Torch-free: the unit is counted
by ``zerobridge.runtime.wrap_units.bucket_sizes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerobridge.spec import AUTO, DType, StrategySpec
from zerobridge.spec.stage import Stage
from zerobridge.translate.mapping import load_table
from zerobridge.translate.report import Impact, Report, Status

__all__ = ["UNBOUNDED", "BucketSizes", "bucket_cost", "bucket_value", "gathered_ahead", "gathered_live",
           "reduce_buffers", "size_text", "stepped_in"]


UNBOUNDED = 2**62
"""The element count written for "no bound" (``stage3_max_live_parameters``, the model persistence
threshold); read back, this or more is no bound."""


@dataclass(frozen=True)
class BucketSizes:
    """Element counts to write where the spec says ``"per_unit"``."""

    elements: int
    """The largest wrap unit's parameters, rounded up to even."""
    unit: str
    """Which unit that is (a module name; ``""``: the root), for the report."""
    ranks: int | None = None
    """The ranks the model is sharded over, when known: the sub-group is a unit's partition on them."""
    model: int | None = None
    """Every parameter's elements (a tied one once), rounded up to even, when known: no reduction holds
    more (``capped``)."""
    hidden: int | None = None
    """The model's hidden size, when it states one (a Hugging Face config's ``hidden_size``): the reduce
    bucket is its square, as HF Trainer fills ``"auto"``."""

    @classmethod
    def for_unit(cls, numel: int, *, unit: str, ranks: int | None = None, model: int | None = None,
                 hidden: int | None = None) -> BucketSizes:
        """Sizes for a largest wrap unit of ``numel`` parameters (sharded over ``ranks``, when known) in a
        model of ``model`` parameters and hidden size ``hidden`` (each when known)."""
        return cls(elements=_even(numel), unit=unit, ranks=ranks, model=None if model is None else _even(model),
                   hidden=hidden)

    def capped(self, elements: int) -> int | None:
        """A stated ``reduce_bucket_size`` of ``elements`` cut to the model's size, when it is larger:
        DeepSpeed preallocates the whole bucket, and every gradient fits one bucket at either size, so
        the reductions are the same; ``None`` when it is not larger or the model's size is not known."""
        return self.model if self.model is not None and elements > self.model else None

    @property
    def reduce(self) -> int:
        """``reduce_bucket_size``: ``hidden_size^2`` elements where the model states a hidden size (what
        HF Trainer fills ``"auto"`` with; at most the largest unit), else one largest unit's gradients."""
        if self.hidden is None:
            return self.elements
        return min(self.elements, _even(self.hidden * self.hidden))

    @property
    def allgather(self) -> int:
        """``allgather_bucket_size``: one unit's parameters per all-gather after the step (stages 1-2)."""
        return self.elements

    @property
    def prefetch(self) -> int:
        """``stage3_prefetch_bucket_size``: one unit gathered ahead of use, as FSDP prefetches one unit."""
        return self.elements

    @property
    def live(self) -> int:
        """``stage3_max_live_parameters``: one largest unit's parameters gathered at once. Without a
        bound DeepSpeed prefetches as far as the prefetch bucket reaches (tiny Llama, ZeRO-3 bf16,
        world 2: forward peak 73.1 MiB unbounded, 67.6 MiB at this bound; FSDP2 55.4 MiB)."""
        return self.elements

    @property
    def sub_group(self) -> int:
        """``sub_group_size`` at stage 3: the largest unit's partition on ``ranks`` ranks (the whole unit
        when the world size is not known). DeepSpeed steps its flat fp32 partition one sub-group at a
        time, and the step's flat fp32 gradient copy and a torch optimizer's temporaries are a
        sub-group's; with the default (1e9) they are the whole partition's, where FSDP steps one
        parameter at a time."""
        return max(1, -(-self.elements // (self.ranks or 1)))

    @property
    def basis(self) -> str:
        """The sentence the report gives for these sizes."""
        where = f"'{self.unit}'" if self.unit else "the root module"
        return f"{self.elements:,} elements, the largest wrap unit ({where})"

    def basis_of(self, name: str) -> str:
        """The sentence the report gives for bucket ``name`` (``reduce_bucket``, ...)."""
        if name == "reduce_bucket" and self.reduce != self.elements:
            return (f"hidden_size^2 = {self.reduce:,} elements, what HF Trainer fills \"auto\" with (a gradient "
                    f"larger than the bucket is reduced from its own tensor; the largest unit holds "
                    f"{self.elements:,})")
        return self.basis


def _even(numel: int) -> int:
    """``numel`` rounded up to even, at least 2 (DeepSpeed asserts even all-gather buckets)."""
    return max(2, numel + numel % 2)


def size_text(nbytes: float) -> str:
    """Bytes in binary units with three significant digits: ``3.73 GiB``, ``120 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:#.3g}".rstrip(".") + f" {unit}"
    return f"{int(nbytes)} B"


def _dtype(dtype: DType | str) -> DType:
    """The dtype the buffers hold: ``"auto"`` costs at most fp32."""
    return dtype if isinstance(dtype, DType) else DType.FP32


def reduce_buffers(elements: int, *, stage: int, overlap: bool, dtype: DType | str) -> str:
    """What DeepSpeed holds for a ``reduce_bucket_size`` of ``elements`` at ``stage``, with the bytes."""
    held = _dtype(dtype)
    if stage == 3:
        return (f"DeepSpeed preallocates one flat reduce bucket of reduce_bucket_size elements: "
                f"{size_text(elements * held.num_bytes)} in {held.value}")
    if stage == 0:
        return (f"DeepSpeed flattens up to reduce_bucket_size gradient elements per all-reduce: "
                f"{size_text(elements * held.num_bytes)} in {held.value}")
    copies = 2 if overlap else 1
    return (f"DeepSpeed preallocates {copies} x reduce_bucket_size elements{' with overlap_comm' if overlap else ''}: "
            f"{size_text(copies * elements * held.num_bytes)} in {held.value}")


def gathered_ahead(elements: int, *, dtype: DType | str) -> str:
    """What DeepSpeed gathers ahead of use for a ``stage3_prefetch_bucket_size`` of ``elements``."""
    held = _dtype(dtype)
    return (f"DeepSpeed gathers up to stage3_prefetch_bucket_size parameter elements ahead of use: "
            f"{size_text(elements * held.num_bytes)} in {held.value}")


def gathered_live(elements: int, *, dtype: DType | str) -> str:
    """What DeepSpeed keeps gathered at most for a ``stage3_max_live_parameters`` of ``elements``."""
    held = _dtype(dtype)
    return (f"at most stage3_max_live_parameters gathered parameter elements are kept: "
            f"{size_text(elements * held.num_bytes)} in {held.value}")


def stepped_in(elements: int) -> str:
    """What DeepSpeed's stage-3 step holds at most for a ``sub_group_size`` of ``elements``."""
    return (f"DeepSpeed steps its partition in sub-groups of at least sub_group_size elements: the step's fp32 "
            f"gradient copy and a torch AdamW's two temporaries are a sub-group's, "
            f"{size_text(3 * 4 * elements)} in fp32 for a sub-group of that size")


def bucket_value(spec: StrategySpec, stage: Stage, name: str, key: str, report: Report, sizes: BucketSizes | None,
            *, used: bool) -> Any:
    """The value of bucket ``name`` (``zero_optimization.key``): the spec's own number or ``"auto"``
    kept; ``per_unit`` sized from the model when ``sizes`` is known (``deepspeed_buckets.py``), else
    ``"auto"`` where HF Trainer and Accelerate fill it from the model (the reduce bucket, and the
    prefetch bucket at stage 3), else DeepSpeed's default, which then costs no memory."""
    value = getattr(spec.communication, name)
    if value != "per_unit":
        cap = sizes.capped(value) if sizes is not None and name == "reduce_bucket" and isinstance(value, int) \
            else None
        if cap is None:
            return value
        report.add(f"communication.{name}", Status.EQUIVALENT,
                   f"{value:,} elements stated, more than the model's {cap:,} parameters: written as {cap:,}, "
                   f"the same reductions (every gradient fits one bucket at either size) without preallocating "
                   f"the rest ({bucket_cost(name, value, stage, spec)} stated; "
                   f"{bucket_cost(name, cap, stage, spec)} written)",
                   target=f"zero_optimization.{key}", impact=Impact.MEMORY)
        return cap
    why = "one collective per wrap unit has no DeepSpeed form"
    default = int(load_table("deepspeed").row(f"zero_optimization.{key}").default)
    filled = name == "reduce_bucket" or (name == "prefetch_bucket" and stage is Stage.PARAMETERS)
    if sizes is not None:
        written: Any = getattr(sizes, name.removesuffix("_bucket"))
        note = f"{why}; sized to {sizes.basis_of(name)}: {bucket_cost(name, written, stage, spec)}"
    elif not filled:  # the all-gather bucket (no buffer), or prefetch below stage 3 (unused)
        written = default
        note = f"{why}; DeepSpeed's default ({written:.0e} elements) written: {bucket_cost(name, written, stage, spec)}"
    else:
        written = AUTO
        fills = "hidden_size^2" if name == "reduce_bucket" else "0.9 x hidden_size^2"
        note = (f"{why}; written as \"auto\", which HF Trainer and Accelerate fill with {fills}; plain "
                f"deepspeed.initialize drops \"auto\" for its default, {default:.0e} elements "
                f"({bucket_cost(name, default, stage, spec)}): pass --model config.json to zerobridge convert to size "
                "it for the model")
    if used:  # the all-gather bucket costs no memory in DeepSpeed: speed only, whatever its size
        report.add(f"communication.{name}", Status.APPROXIMATED, note, target=f"zero_optimization.{key}",
                   impact=Impact.SPEED if name == "allgather_bucket" else None)
    return written


def bucket_cost(name: str, elements: int, stage: Stage, spec: StrategySpec) -> str:
    """What bucket ``name`` of ``elements`` costs in DeepSpeed at ``stage``, with the bytes (a sentence)."""
    dtype = spec.precision.param_dtype
    if name == "reduce_bucket":
        return reduce_buffers(elements, stage=stage.value, overlap=spec.communication.overlap_reduce, dtype=dtype)
    if name == "prefetch_bucket":
        return gathered_ahead(elements, dtype=dtype)
    return "no buffer of its own (the all-gather after the step fills the flat parameter buffer)"
