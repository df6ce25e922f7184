"""DeepSpeed's buffers beyond the native engine's, as named terms sized from a DeepSpeed JSON: arithmetic
only, no tensors (``deepspeed_memory.py`` allocates them beside the native engine's fake run).

    >>> from zerobridge.planning.deepspeed_terms import buffers_for
    >>> config = {"bf16": {"enabled": False},
    ...           "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000}}
    >>> b = buffers_for(config, params=10_000, world_size=2)
    >>> b.master_copy, b.grad_partition, b.reduce_buckets, b.fp32_grad_copy
    (20000, 20000, 8000, 0)

Each term, and when DeepSpeed holds it (DeepSpeed 0.19.8, ``stage_1_and_2.py`` and ``stage3.py``):

- ``master_copy``: DeepSpeed keeps an fp32 master partition apart from the
  parameters even in an fp32 run (``single_partition_of_fp32_groups``,
  ``fp32_partitioned_groups_flat``); the native engine steps its fp32
  parameters in place, and in a mixed run holds the master as DeepSpeed does
  (no term). From setup on.
- ``grad_partition``: the native engine's own gradient shard stands for
  DeepSpeed's gradient partition, with no term of its own. Stages 1-2: the
  contiguous partition (``grads_in_partition``) holds the backward's
  gradients until the step consumes them and is then freed; the native
  shard is freed after each step too (``FlatGroup.release_grads``), and in a
  16-bit run before the optimizer runs (the step casts the partition to
  fp32 first). DeepSpeed makes the partition at the first gradient that
  falls in it, not as backward opens: the native run makes its shard at
  its first reduction (``FlatGroup.defer_store``; the rank whose part
  comes first in backward makes it there). DeepSpeed moves each gradient
  into its reduce bucket (a term) as it is produced and reduces the bucket
  once the next gradient does not fit, in the order the gradients come:
  the native run is cut in buckets of ``reduce_bucket_size`` (a larger
  parameter alone) and reduces each as it is ready
  (``ReductionQueue.arrival``), rather than holding the whole model's
  gradients in one buffer at the end of its backward (38.7 MiB above its
  resting state on the tiny Llama in fp32). The native engine cut its
  replicated buckets' views at the root's pre-forward, so each of their
  gradients fired only at the end of backward whatever the buckets
  (``engine/bucket_views.py``); with them cut at their first module, the
  Qwen2 cells went from 10.7% over real DeepSpeed to exact, and the tiny
  Llama's ZeRO-2 with checkpointing on 4 ranks from 29.4% over to exact.
  Stage 3's flat gradient partition (``grad_partitions_flat_buffer``), from
  setup until the first backward. From there the native engine's gradient shard holds the same gradients
  and stands for it: the engine keeps that shard between steps (zeroed, not
  freed). Counting both held the gradients twice: in the backward (the 20M
  GPT's ZeRO-3 fp32 backward planned 26% over real DeepSpeed), and, with
  the partition added back after each step, through the next forward (the
  same model's forward planned 307.6 MiB against DeepSpeed's 269.7, one
  38.3 MiB partition over).
- ``reduce_buckets``: stages 1-2 allocate ``reduce_bucket_size`` elements in
  the parameters' dtype when the first gradient of a micro-step is ready
  (``setup_buckets``), twice with ``overlap_comm``, and free them at the end
  of that backward. Stage 3 preallocates one flat bucket at setup
  (``__ipg_bucket_flat_buffer``) and keeps it. It flushes the bucket once
  the next gradient does not fit, and reduces a gradient larger than the
  bucket on its own (the JSON written for a known model sizes it to
  hidden_size^2), holding no reduction in flight beyond its buckets: the
  native run lands each reduction as it issues it (``ReductionQueue.limit``
  0), at every stage. With the native engine's two in flight the model
  planned the 20M GPT's ZeRO-3 fp32 with checkpointing 15.6% over real
  DeepSpeed; landed at once, 5.5%.
- ``kept_grads``: stage 1 clears the gradients of parameters outside the
  rank's partition only at the step, where stage 2 clears them once
  reduced: a gradient that went through the reduce bucket is a view of the
  bucket, but one larger than the bucket keeps its own tensor
  (``extra_large_param_to_reduce``), from the moment it is made until the
  step. The busiest rank's (the one whose partition leaves out the most such
  bytes), made as each of those parameters' gradients is ready. Without
  it the model planned the tiny Llama's ZeRO-1 with checkpointing in fp32 on
  4 ranks 7.8% under real DeepSpeed, whose ranks held 4.0 to 7.8 MiB more
  than at stage 2.
- ``flat_copy``: stages 1-2 step from a flat copy of the partition's
  gradients (``flatten(averaged_gradients)``), made while the partition is
  still held; in an fp32 run it is the gradient the optimizer steps. So the
  step has two moments: the copy (and, 16-bit, its fp32 cast) beside the
  partition, then, the partition and a 16-bit copy freed, the fp32 gradient
  beside the optimizer's temporaries. Counted as one gradient beside the
  temporaries, the model matched real DeepSpeed with torch's AdamW (whose two
  temporaries outweigh the first moment) and planned its steps with a fused
  AdamW 9.5 MiB under (tiny Llama, 2 ranks, 5.0M parameters: 17.1% under on
  the 20M GPT's ZeRO-2 with checkpointing in bf16).
- ``fp32_grad_copy``: the flat fp32 gradient the optimizer steps: in a
  16-bit run the step casts the flat copy to fp32
  (``single_grad_partition``); stage 3 flattens it in fp32 too
  (``_prepare_fp32_grad_for_sub_group``: ``flatten(...)`` is a copy). In an
  fp32 run at stages 1-2 the flat copy is that gradient (``.to`` returns it).
- ``adam_temporaries``: torch's AdamW steps DeepSpeed's one flat fp32
  partition, so its two temporaries (``exp_avg_sq.sqrt()`` and its quotient)
  are partition-sized, on top of the optimizer state and the fp32 gradient:
  where a real stage-3 bf16 run peaks (``stage3.py`` ``_optimizer_step``,
  measured: 30.0 MB above the live bytes after backward on the tiny Llama,
  the fp32 gradient and two temporaries of 10.0 MB each). At stage 3 both
  are one sub-group's (``largest_sub_group``): DeepSpeed steps its
  partition a sub-group at a time, and the JSON written for a known model
  sizes ``sub_group_size`` to the largest unit's partition.
- ``persistent``: stage-3 parameters of at most
  ``stage3_param_persistence_threshold`` elements stay whole on every rank.
- DeepSpeed's all-gather bucket allocates nothing of its own.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["DeepSpeedBuffers", "buffers_for", "largest_sub_group", "stage1_kept"]


class DeepSpeedBuffers(BaseModel):
    """DeepSpeed's buffers beyond the native engine's, in bytes per rank (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int
    dtype_bytes: int
    """Bytes per element of the parameters (and gradients): 4 in fp32, 2 in bf16 or fp16."""
    master_copy: int
    grad_partition: int
    reduce_buckets: int
    """Stages 1-2: per micro-step, while the backward runs; stage 3: the one flat bucket, from setup on."""
    fp32_grad_copy: int
    flat_copy: int = 0
    """Stages 1-2: the flat copy of the partition's gradients the step makes (``flat_copy``)."""
    kept_grads: int = 0
    """Stage 1: gradients larger than the reduce bucket, of parameters outside the busiest rank's
    partition, kept from their backward until the step (``kept_grads``)."""
    adam_temporaries: int = 0
    """Torch AdamW steps DeepSpeed's one flat fp32 partition, so its temporaries are partition-sized:
    ``denom = exp_avg_sq.sqrt() / c`` holds two at once (the square root and the quotient), both
    counted. The native engine's own step temporaries (its per-tile fp32 casts and AdamW's on each
    shard) are not DeepSpeed's: the native step runs uncounted (``NATIVE_STEP``) and these terms
    stand for DeepSpeed's."""
    persistent: int = 0

    @property
    def resident(self) -> int:
        """Bytes held from setup on."""
        held = self.master_copy + self.persistent
        return held + (self.grad_partition + self.reduce_buckets if self.stage == 3 else 0)


def largest_sub_group(numels: list[int], *, world_size: int, sub_group_size: int) -> int:
    """Partition elements of the largest stage-3 sub-group, cut as DeepSpeed cuts them: parameters in
    order, each adding its partition (``ceil(numel / world_size)``), a sub-group closed once it holds
    ``sub_group_size`` or more (so it can pass the size by one parameter's partition)."""
    largest = filled = 0
    for part in (-(-n // world_size) for n in numels):
        filled += part
        if filled >= sub_group_size:
            largest, filled = max(largest, filled), 0
    return max(largest, filled)


def stage1_kept(numels: list[int], *, world_size: int, bucket: int) -> list[int]:
    """Positions (in ``numels``, the trainable parameters in order) of the parameters whose gradients
    DeepSpeed's stage 1 keeps until the step on its busiest rank: larger than the reduce ``bucket`` and
    outside that rank's partition (DeepSpeed flattens the parameters in order and gives rank r the
    r-th of N equal parts; a parameter that reaches into a part is in it).

        >>> stage1_kept([8, 2, 8, 10], world_size=2, bucket=4)   # rank 0 holds [0, 14), rank 1 [14, 28)
        [3]

    Rank 0 keeps the last parameter's 10 elements, rank 1 the first's 8 (the 2 go through the bucket;
    the third reaches into both parts)."""
    part = -(-sum(numels) // world_size)
    starts = [0, *accumulate(numels)][:-1]
    best: list[int] = []
    for rank in range(world_size):
        low, high = rank * part, (rank + 1) * part
        kept = [i for i, (start, n) in enumerate(zip(starts, numels))
                if n > bucket and (start + n <= low or start >= high)]
        if sum(numels[i] for i in kept) > sum(numels[i] for i in best):
            best = kept
    return best


def buffers_for(config: dict[str, Any], *, params: int, world_size: int,
                persistent_params: int = 0, sub_group: int | None = None, kept: int = 0) -> DeepSpeedBuffers:
    """The terms for a DeepSpeed JSON ``config`` training ``params`` parameters on ``world_size``
    ranks; ``persistent_params``: stage-3 elements kept whole (at most the persistence threshold each);
    ``sub_group``: the largest stage-3 sub-group's elements (``largest_sub_group``; the whole
    partition when not given): the step's fp32 gradient copy and AdamW's temporaries are its size;
    ``kept``: stage 1's kept gradients' elements (``stage1_kept``)."""
    zero = config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    low = bool(config.get("bf16", {}).get("enabled")) or bool(config.get("fp16", {}).get("enabled"))
    size = 2 if low else 4
    part = -(-params // world_size)
    bucket = int(zero.get("reduce_bucket_size", 500_000_000))
    overlap = bool(zero.get("overlap_comm", stage == 3))
    copies = 2 if overlap and stage < 3 else 1
    shared = persistent_params - persistent_params // world_size
    stepped = min(part, sub_group) if stage == 3 and sub_group is not None else part
    return DeepSpeedBuffers(stage=stage, dtype_bytes=size, master_copy=0 if low else 4 * part,
                            grad_partition=size * part, reduce_buckets=copies * size * bucket,
                            fp32_grad_copy=4 * stepped if low or stage == 3 else 0, adam_temporaries=2 * 4 * stepped,
                            flat_copy=size * part if stage < 3 else 0,
                            kept_grads=size * kept if stage == 1 else 0,
                            persistent=size * shared if stage == 3 else 0)
