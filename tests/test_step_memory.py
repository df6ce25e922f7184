"""Peak live bytes while the optimizer steps, against explain's model-state formula.

The native engine runs the 20M GPT as rank 0 of a fake world of 2 (``planning.fake_run``: the real
engine code on fake tensors) and ``StorageTracker`` counts every live storage after every
operation, so the figures are exact byte counts, not timings. With 16-bit gradients in the store
(``compute_copy`` stored or gathered, bf16 accumulation) the optimizer's fp32 gradients are cast a
tile at a time at the step (``engine/step.py``), not all at once (they were: 1.24-1.32x the
formula, +4P/N). What stays above the formula is torch's single-tensor AdamW's own temporaries
(two fp32 copies of the tensor it steps) and one tile of fp32 gradients: at stages 0 and 3 that is
under 5%; at stages 1 and 2 a rank's contiguous shard holds whole 1M-element matrices (5% of this
model each), so the tile is one whole matrix (measured 1.063x and 1.070x in bf16, 1.035x and
1.042x in fp32).
"""

from __future__ import annotations

from functools import cache

import pytest

from zerobridge.explain import explain
from zerobridge.planning.fake_run import Run, run_once
from zerobridge.planning.models import ModelSource, resolve_model
from zerobridge.spec import PrecisionSpec, StrategySpec
from zerobridge.spec.presets import spec_for_stage

RUN = Run(world_size=2, nodes=1, micro_batch=2, seq_len=128)
PRECISIONS = ("fp32", "bf16-stored", "bf16-gathered")


@cache
def _source() -> ModelSource:
    return resolve_model("tiny-gpt:20m")


def _spec(stage: int, precision: str) -> StrategySpec:
    spec = spec_for_stage(stage, _source().build(2))
    if precision == "fp32":
        return spec
    layout = precision.split("-")[1]
    return spec.model_copy(update={"precision": PrecisionSpec(param_dtype="bf16", master_dtype="fp32",
                                                              compute_copy=layout)})


@cache
def _step_extra(stage: int, precision: str) -> tuple[int, int]:
    """(step peak minus the formula, the formula) in bytes."""
    spec = _spec(stage, precision)
    formula = explain(spec, params=_source().params, world_size=2, local_world_size=2).model_state_bytes
    return run_once(_source(), spec, RUN).peaks["step"] - formula, formula


@pytest.mark.parametrize("precision", PRECISIONS[:2])
@pytest.mark.parametrize("stage", [0, 3])
def test_the_step_peaks_within_5_percent_of_the_formula(stage: int, precision: str) -> None:
    """The flat fp32 layout and DeepSpeed's stored bf16 one. (FSDP's gathered layout with bf16
    gradients measures 1.0504x at stage 3: its formula is 14P/N, not 16P/N, for the same
    temporaries; with the fp32 gradients FSDP2 users run it with, nothing is cast at all.)"""
    extra, formula = _step_extra(stage, precision)
    assert extra <= 0.05 * formula, (stage, precision, (formula + extra) / formula)


@pytest.mark.parametrize("precision", PRECISIONS[1:])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_16bit_gradients_add_one_tile_to_the_step_not_a_copy(stage: int, precision: str) -> None:
    """Beyond what fp32 training holds over its own formula (AdamW's temporaries), the 16-bit
    layouts hold at most one tile of fp32 gradients: a 64th of the gradient shard, or the largest
    parameter when it is bigger. The whole fp32 copy would be 4P/N (P/N: elements per rank)."""
    extra, _ = _step_extra(stage, precision)
    fp32_extra, _ = _step_extra(stage, "fp32")
    params = _source().params
    largest = max(p.numel() for p in _source().build(2).parameters())
    shard = params // (2 if stage >= 2 else 1)
    assert extra - fp32_extra <= 4 * max(largest, shard // 64), (stage, precision, extra, fp32_extra)
    assert extra - fp32_extra < 4 * shard // 8
