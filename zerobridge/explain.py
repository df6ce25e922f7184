"""What a strategy costs per rank: model-state bytes and traffic per step.

    >>> from zerobridge.explain import explain, format_bytes
    >>> from zerobridge.spec import PrecisionSpec, ShardingSpec, StrategySpec
    >>> spec = StrategySpec(sharding=ShardingSpec.for_stage(3),
    ...                     precision=PrecisionSpec(param_dtype="bf16", master_dtype="fp32"))
    >>> e = explain(spec, params=7_500_000_000, world_size=64)
    >>> format_bytes(e.model_state_bytes), e.formula
    ('1.88 GB', '16P/N')
    >>> [(c.collective, format_bytes(c.payload_bytes)) for c in e.comms]
    [('reduce-scatter', '15.0 GB'), ('all-gather', '15.0 GB'), ('all-gather', '15.0 GB')]

Model states are counted as in the ZeRO paper (parameters, gradients,
optimizer state including a separate master copy); activations, gathered
parameters during compute and communication buffers are not. A shard holds
``ceil(P / N)`` elements: DeepSpeed and FSDP pad flat buffers to a multiple of
the group size. Traffic uses the bus-volume convention: per rank, an
all-reduce of ``n`` bytes over ``G`` ranks moves ``2n(G-1)/G``, a
reduce-scatter (``n``-byte input) or all-gather (``n``-byte output) ``n(G-1)/G``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Literal

from zerobridge.errors import ConfigError
from zerobridge.spec import DType, GradSync, OffloadDevice, ParamSharding, StrategySpec, WireFormat, is_auto
from zerobridge.spec.wire import wire_bytes

__all__ = ["CommRow", "Explanation", "StateRow", "explain", "format_bytes"]

Tier = Literal["accelerator", "cpu", "nvme"]
Collective = Literal["all-reduce", "reduce-scatter", "all-gather", "all-to-all"]
TIERS: dict[OffloadDevice, Tier] = {
    OffloadDevice.NONE: "accelerator", OffloadDevice.CPU: "cpu", OffloadDevice.NVME: "nvme"}
MOMENTS = {"adam": 2, "sgd": 1}


@dataclass(frozen=True)
class StateRow:
    """One model state (or the share of it that lives on one tier) on one rank."""

    name: str
    sharded: bool
    group_size: int
    """Ranks the state is split over (1: every rank holds all of it)."""
    tier: Tier
    bytes_per_rank: int
    formula: str
    """Bytes in terms of P (parameters), N (shard group) and k (hpZ group)."""


@dataclass(frozen=True)
class CommRow:
    """One collective issued ``count_per_step`` times per optimizer step."""

    collective: Collective
    purpose: str
    group_size: int
    payload_bytes: int
    """All-reduce: the buffer; reduce-scatter: the input; all-gather: the output."""
    bus_bytes_per_rank: int
    count_per_step: int

    @property
    def bus_bytes_per_step(self) -> int:
        """Bytes one rank moves for this row in one optimizer step."""
        return self.bus_bytes_per_rank * self.count_per_step


@dataclass(frozen=True)
class Explanation:
    """Per-rank memory and traffic of one strategy at one model and world size."""

    summary: str
    params: int
    world_size: int
    shard_group_size: int
    replicas: int
    optimizer: str
    accumulation_steps: int
    formula: str
    """Total model-state bytes per rank, e.g. ``4P + 12P/N``."""
    states: tuple[StateRow, ...]
    comms: tuple[CommRow, ...]
    notes: tuple[str, ...]

    def bytes_per_tier(self) -> dict[str, int]:
        """Model-state bytes per rank on each tier that holds any."""
        out: dict[str, int] = defaultdict(int)
        for row in self.states:
            out[row.tier] += row.bytes_per_rank
        return dict(out)

    def bytes_per_state(self) -> dict[str, int]:
        """Bytes per rank of each state, summed over tiers."""
        out: dict[str, int] = defaultdict(int)
        for row in self.states:
            out[row.name] += row.bytes_per_rank
        return dict(out)

    @property
    def model_state_bytes(self) -> int:
        """Model-state bytes per rank over all tiers."""
        return sum(row.bytes_per_rank for row in self.states)

    @property
    def comm_bytes_per_step(self) -> int:
        """Bus bytes one rank moves per optimizer step."""
        return sum(row.bus_bytes_per_step for row in self.comms)

    def render(self) -> str:
        """A plain-text report."""
        lines = [
            self.summary,
            f"{self.params:,} parameters (P), {self.optimizer}, world {self.world_size} = "
            f"{self.replicas} replica(s) x shard group N={self.shard_group_size}, "
            f"{self.accumulation_steps} micro-step(s) per step",
            "",
            "Model states per rank:",
            f"  {'state':<22}{'sharded':<15}{'tier':<13}{'bytes':>10}  formula",
        ]
        for r in self.states:
            where = f"over {r.group_size}" if r.sharded else "no"
            lines.append(f"  {r.name:<22}{where:<15}{r.tier:<13}{format_bytes(r.bytes_per_rank):>10}  {r.formula}")
        lines.append(f"  {'total':<50}{format_bytes(self.model_state_bytes):>10}  {self.formula}")
        lines.append("  per tier: " + ", ".join(f"{t} {format_bytes(b)}" for t, b in self.bytes_per_tier().items()))
        lines += ["", "Communication per optimizer step (per rank, bus volume):",
                  f"  {'collective':<16}{'purpose':<34}{'group':>6}{'payload':>10}{'count':>6}{'moved':>10}"]
        for c in self.comms:
            lines.append(f"  {c.collective:<16}{c.purpose:<34}{c.group_size:>6}{format_bytes(c.payload_bytes):>10}"
                         f"{c.count_per_step:>6}{format_bytes(c.bus_bytes_per_step):>10}")
        lines.append(f"  {'total':<72}{format_bytes(self.comm_bytes_per_step):>10}")
        lines += ["", "Not counted: activations, parameters gathered for compute, buffers."]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """JSON-compatible data, totals included."""
        data = asdict(self)
        data.update(states=[asdict(r) for r in self.states], comms=[asdict(c) for c in self.comms],
                    notes=list(self.notes), bytes_per_tier=self.bytes_per_tier(),
                    model_state_bytes=self.model_state_bytes, comm_bytes_per_step=self.comm_bytes_per_step)
        return data


def format_bytes(n: int) -> str:
    """Decimal units with three significant digits: ``1.88 GB``, ``120 GB``."""
    if n < 1000:
        return f"{n} B"
    for unit, scale in (("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12)):
        text = f"{n / scale:#.3g}".rstrip(".")
        if float(text) < 1000 or unit == "TB":
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _bus(collective: Collective, payload: int, group: int) -> int:
    factor = 2 if collective == "all-reduce" else 1
    return _ceil_div(factor * payload * (group - 1), group)


def _term(coef: int, symbol: str) -> str:
    text = f"{coef}P"
    return f"{text}/{symbol}" if symbol else text


def explain(
    spec: StrategySpec,
    *,
    params: int,
    world_size: int,
    local_world_size: int | None = None,
    optimizer: Literal["adam", "sgd"] = "adam",
    auto_dtype: DType = DType.BF16,
) -> Explanation:
    """Model-state bytes per rank and collectives per optimizer step of ``spec``
    for a model of ``params`` parameters on ``world_size`` data-parallel ranks."""
    s, prec = spec.sharding, spec.precision
    notes: list[str] = []
    if params < 1 or world_size < 1:
        raise ConfigError(f"params={params}, world_size={world_size}: both must be positive integers")
    if optimizer not in MOMENTS:
        raise ConfigError(f"unknown optimizer {optimizer!r}", fix="use 'adam' or 'sgd'")
    local = min(8, world_size) if local_world_size is None else local_world_size
    if not 1 <= local <= world_size:
        raise ConfigError(f"local_world_size={local} must be between 1 and world_size={world_size}")
    if s.world_size is not None and s.world_size != world_size:
        raise ConfigError(f"the spec fixes the world size to {s.world_size}, asked for {world_size}",
                          key="sharding.world_size",
                          fix=f"pass world_size={s.world_size}, or set sharding.world_size to {world_size} or null")
    n = s.resolve_group(s.shard_group, world_size=world_size, local_world_size=local)
    if n > world_size or world_size % n:
        raise ConfigError(f"shard group of {n} ranks does not divide the world size {world_size}",
                          key="sharding.shard_group",
                          fix=f"use a world size that is a multiple of {n}, or a shard group that divides {world_size}")
    replicas = world_size // n

    def dtype(name: str, fallback: DType) -> DType:
        value = getattr(prec, name)
        if is_auto(value):
            notes.append(f"precision.{name} is 'auto': counted as {fallback.value}")
            return fallback
        return DType(value)

    # 'auto' reduce and accumulation dtypes follow the compute dtype, as every engine resolves them
    pdt = dtype("param_dtype", auto_dtype)
    rdt, adt, mdt = dtype("reduce_dtype", pdt), dtype("accumulate_dtype", pdt), prec.master_dtype
    if mdt not in (DType.FP32, pdt):
        raise ConfigError(f"master_dtype={mdt.value} with param_dtype resolved to {pdt.value}",
                          key="precision.master_dtype", fix="use master_dtype fp32 or the compute dtype")
    accumulation = spec.batch.accumulation_steps
    micro = accumulation if isinstance(accumulation, int) else 1
    if not isinstance(accumulation, int):
        why = "'auto'" if is_auto(accumulation) else "derived at run time"
        notes.append(f"batch.accumulation_steps is {why}: counted as 1 micro-step per step")

    # ---- model states ----
    states: list[StateRow] = []
    coefs: dict[str, int] = defaultdict(int)
    shard = _ceil_div(params, n)

    def add(name: str, per_elem: int, sharded: bool, tier: Tier, *, group: int = n, symbol: str = "N",
            offload_tier: Tier | None = None, ratio: float = 1.0) -> None:
        if not sharded:
            group, symbol = 1, ""
        total = _ceil_div(params, group) * per_elem
        coefs[symbol] += per_elem
        formula = _term(per_elem, symbol)
        if offload_tier is None or ratio >= 1.0:
            states.append(StateRow(name, sharded, group, offload_tier or tier, total, formula))
            return
        off = round(total * ratio)
        states.append(StateRow(name, sharded, group, tier, total - off, f"{formula} x {1 - ratio:g}"))
        states.append(StateRow(name, sharded, group, offload_tier, off, f"{formula} x {ratio:g}"))

    opt = spec.offload.optimizer
    opt_tier = TIERS[opt.device] if opt.enabled else None
    mixed = mdt is not pdt
    # FSDP's layout where the engine runs it: the sharded fp32 parameters are the master.
    gathered = spec.gathers_compute_copy and s.parameters.sharded_at_rest
    if mixed and prec.compute_copy == "gathered" and not gathered:
        why = "parameters are replicated at rest" if not s.parameters.sharded_at_rest else "an offload tier is on"
        notes.append(f"compute_copy 'gathered': {why}, so the 16-bit copy is stored beside the fp32 master")
    add("parameters", (mdt if gathered else pdt).num_bytes, s.parameters.sharded_at_rest,
        TIERS[spec.offload.parameters.device])
    add("gradients", adt.num_bytes, s.gradients, "accelerator",
        offload_tier=opt_tier if s.gradients else None, ratio=opt.ratio)
    master = mdt.num_bytes if mixed and not gathered else 0
    add("optimizer_state", master + MOMENTS[optimizer] * mdt.num_bytes, s.optimizer_state, "accelerator",
        offload_tier=opt_tier, ratio=opt.ratio)
    k = None
    if s.backward_gather_group is not None:
        k = s.resolve_group(s.backward_gather_group, world_size=world_size, local_world_size=local)
        if k > n or n % k:
            raise ConfigError(f"backward gather group of {k} ranks does not divide the shard group of {n}",
                              key="sharding.backward_gather_group", fix=f"use a divisor of {n}")
        add("secondary_parameters", pdt.num_bytes, True, "accelerator", group=k, symbol="k")
        notes.append(f"hpZ: a secondary parameter shard over {k} ranks is cut locally after forward (no traffic)")
    formula = " + ".join(_term(c, sym) for sym, c in coefs.items() if c) or "0"

    if opt.enabled:
        if s.gradients:
            notes.append(f"optimizer offload: gradient shards are counted on {opt_tier} with the optimizer state")
        else:
            notes.append("optimizer offload: full gradients stay on the accelerator; the shard copied to the "
                         "host for the step is not counted")
        notes.append("host-accelerator transfers of offloaded states are not counted as traffic")
    if gathered:
        notes.append(f"compute_copy 'gathered': the {pdt.value} copy of a unit exists only while it is gathered")
    if adt is not mdt and not opt.enabled:
        notes.append(f"{adt.value} gradients are cast to {mdt.value} for the optimizer at the step and dropped "
                     "after it: not counted (DeepSpeed's estimator adds 4 bytes per parameter of fp32 "
                     "gradient partitions)")
    threshold = spec.communication.persistence_threshold
    if s.parameters.sharded_at_rest and isinstance(threshold, int) and threshold > 0:
        notes.append(f"parameters below persistence_threshold={threshold} stay unsharded: not modeled")

    # ---- communication ----
    comms: list[CommRow] = []

    def coll(kind: Collective, purpose: str, group: int, payload: int, count: int) -> None:
        comms.append(CommRow(kind, purpose, group, payload, _bus(kind, payload, group), count))

    wire = spec.communication.wire
    if wire.frozen_weights is not WireFormat.FULL:
        notes.append(f"frozen_weights={wire.frozen_weights.value}: frozen parameters (not counted apart here: every "
                     f"parameter is taken as trainable) are held as {wire.frozen_weights.value} codes, about "
                     f"1 + 4/{wire.block_size} bytes each per shard, with no master and no gradient")
    grad_count = micro if spec.batch.grad_sync is GradSync.EVERY_MICRO_STEP else 1
    if not s.optimizer_state:
        coll("all-reduce", "gradients", world_size, params * rdt.num_bytes, grad_count)
        if n != world_size:
            notes.append("nothing is sharded: the shard group is ignored and gradients are all-reduced over the world")
    elif wire.grad_reduce is not WireFormat.FULL and n > 1:
        fmt, block = wire.grad_reduce, wire.grad_block_size
        if 1 < local < n and n % local == 0:  # two hops: inside the node, then between nodes
            nodes = n // local
            coll("all-to-all", f"gradients inside the node ({fmt.value})", local,
                 local * wire_bytes(fmt, nodes * shard, block), grad_count)
            coll("all-to-all", f"gradients across nodes ({fmt.value})", nodes,
                 nodes * wire_bytes(fmt, shard, block), grad_count)
        else:
            coll("all-to-all", f"gradients ({fmt.value})", n, n * wire_bytes(fmt, shard, block), grad_count)
        notes.append(f"gradients travel as {fmt.value} in all-to-alls and are summed in fp32 on the owner; "
                     "scales are per block of each piece")
        if replicas > 1:  # summed across replicas as quantized too: an all-to-all, then an all-gather
            part = _ceil_div(shard, replicas)
            coll("all-to-all", f"gradient shard across replicas ({fmt.value})", replicas,
                 replicas * wire_bytes(fmt, part, block), grad_count)
            coll("all-gather", f"gradient shard sums across replicas ({fmt.value})", replicas,
                 replicas * wire_bytes(fmt, part, block), grad_count)
    else:
        coll("reduce-scatter", "gradients", n, shard * n * rdt.num_bytes, grad_count)
        if not s.gradients:
            notes.append("stage 1: gradient reduction modeled as a reduce-scatter (each rank steps only its shard)")
        if replicas > 1:
            coll("all-reduce", "gradient shard across replicas", replicas, shard * rdt.num_bytes, grad_count)
    full_param = shard * n * pdt.num_bytes
    gather_wire = wire.param_gather if n > 1 else WireFormat.FULL
    if gather_wire is not WireFormat.FULL:
        full_param = n * wire_bytes(gather_wire, shard, wire.block_size)
        notes.append(f"parameter all-gathers carry {gather_wire.value} codes and scales; every rank decodes them "
                     f"into {pdt.value}")
    if s.parameters is ParamSharding.REPLICATED and s.optimizer_state:
        coll("all-gather", "updated parameters after step", n, full_param, 1)
    elif s.parameters is ParamSharding.RESHARD_AFTER_BACKWARD:
        coll("all-gather", "parameters for forward+backward", n, full_param, micro)
    elif s.parameters is ParamSharding.RESHARD_AFTER_FORWARD:
        coll("all-gather", "parameters for forward", n, full_param, micro)
        if k is None:
            coll("all-gather", "parameters for backward", n, full_param, micro)
        else:
            coll("all-gather", "parameters for backward (hpZ)", k, _ceil_div(params, k) * k * pdt.num_bytes, micro)
            if gather_wire is not WireFormat.FULL:
                notes.append("hpZ: the backward gathers inside the group carry the secondary shard in full precision")

    return Explanation(
        summary=spec.summary(), params=params, world_size=world_size, shard_group_size=n, replicas=replicas,
        optimizer=optimizer, accumulation_steps=micro, formula=formula, states=tuple(states),
        comms=tuple(comms), notes=tuple(dict.fromkeys(notes)),
    )
