"""One flat group: parameters stored, gathered, reduced and stepped together.

[Note: tensor roles]
- *original parameter*: the ``nn.Parameter`` the user's module held. Its values
  seed the group, then it is dropped.
- *sharded parameter*: an ``nn.Parameter`` per original parameter, under the
  original name, viewing this rank's run of the *master* elements. It is what
  ``model.parameters()`` yields at rest and what the optimizer steps. With
  one shard (stage 0) it has the original shape; otherwise it is 1-D.
- *master*: the elements the optimizer steps. Usually no copy: the sharded
  parameters view ``full`` (replicated) or ``shard`` (sharded) directly. A
  separate ``master`` tensor of this rank's shard when the dtypes differ or
  an offload tier moves it (``GroupPlan.separate_master``); on the nvme tier
  no tensor: the values are in a swap file (``master_file``) and the sharded
  parameters hold placeholders between steps.
- *full* (1-D, padded): the whole group in the compute dtype. Replicated
  groups keep it; sharded groups allocate its storage only while gathered.
- *shard* (1-D): this rank's pieces of ``full``; resident for sharded groups,
  unless the parameter tier keeps them away (``away``: a swap file or a host
  tensor) or a frozen group keeps them quantized (``away``: int8 codes and
  scales): then it has storage only while it is being gathered.
- *leaf*: per bucket, an autograd leaf aliasing the bucket's part of ``full``
  with its own version counter (so refilling ``full`` in backward does not
  trip autograd). Forward views of the parameters are cut from it, so its
  ``.grad`` is the bucket's flat gradient, unused parameters and padding
  filled with zeros.
- *grad store*: where reduced gradients accumulate in the accumulate dtype:
  the shard (gradients sharded) or a full buffer whose own pieces hold the
  reduced values (gradients replicated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from zerobridge.engine import collectives
from zerobridge.engine.collectives import Pending
from zerobridge.engine.layout import BucketLayout, GroupLayout
from zerobridge.engine.mesh import Mesh
from zerobridge.engine.quantized_store import QuantizedRegion
from zerobridge.engine.swapfile import FileRegion, HostRegion, Region
from zerobridge.engine.tiers import ON_DEVICE, Home, Placement, Spaces, place, placeholder, release, reserve
from zerobridge.engine.wire import all_gather_encoded
from zerobridge.runtime.comm_stats import CommStats
from zerobridge.runtime.wrap_units import ParamRef
from zerobridge.spec import ParamSharding, WireFormat

__all__ = ["FlatGroup", "GroupPlan", "ParamRef"]


@dataclass(frozen=True)
class GroupPlan:
    """What one flat group does: a row derived from the spec."""

    sharding: ParamSharding
    shard_grads: bool
    trainable: bool
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype
    accumulate_dtype: torch.dtype
    keep_secondary: bool
    """hpZ: after forward keep a shard over the secondary group for backward."""
    separate_master: bool = False
    """The stepped elements are a copy apart from the compute parameters."""
    master_at: Placement = ON_DEVICE
    """Where that copy lives (trainable: the optimizer tier)."""
    shard_at: Placement = ON_DEVICE
    """Where the shard lives between gathers (the parameter tier; sharded groups)."""
    pin_memory: bool = True
    gathered_copy: bool = False
    """FSDP's layout: the shard holds master-dtype values (it is the master) and the
    compute copy is cast from it at each gather (``precision.compute_copy``)."""
    param_wire: WireFormat = WireFormat.FULL
    """How the shard travels in the parameter all-gathers (``communication.wire.param_gather``)."""
    grad_wire: WireFormat = WireFormat.FULL
    """How gradients travel in the reduce-scatter (``communication.wire.grad_reduce``)."""
    wire_block: int = 2048
    """Elements per scale block of int8 parameter gathers and frozen weights."""
    grad_block: int = 128
    """Elements per scale block of quantized gradient reductions."""
    frozen_wire: WireFormat = WireFormat.FULL
    """How a frozen group's shard is kept at rest (``communication.wire.frozen_weights``): ``int8`` keeps
    codes and scales (``quantized_store.py``), read into the compute shard only while it is gathered."""

    @property
    def shard_dtype(self) -> torch.dtype:
        return self.master_dtype if self.gathered_copy else self.compute_dtype


class GatherState(Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class FlatGroup:
    """Parameters of one wrap unit (or of the replicated part of the model)."""

    def __init__(self, refs: list[ParamRef], layout: GroupLayout, plan: GroupPlan, mesh: Mesh,
                 stats: CommStats, spaces: Spaces | None, device: torch.device) -> None:
        originals = [ref.param for ref in refs if ref.param is not None]
        assert len(originals) == len(refs)
        self.refs = [dataclasses.replace(ref, param=None) for ref in refs]
        self.layout = layout
        self.plan = plan
        self.mesh = mesh
        self.stats = stats
        n, sharded = layout.shards, plan.sharding.sharded_at_rest
        # Initialization: fill full (or shard) and master from the originals (meta: zeros, see materialize.py).
        full = self._flatten(originals, plan.compute_dtype, device)
        self.shard: torch.Tensor | None = None
        self.away: Region | None = None
        self.full = full
        if sharded:
            self.shard = torch.empty(layout.shard_numel, dtype=plan.shard_dtype, device=device)
            self._copy_pieces(full if plan.shard_dtype == full.dtype else
                              self._flatten(originals, plan.shard_dtype, device), self.shard)
            space = spaces.parameters if spaces else None
            if plan.frozen_wire is WireFormat.INT8:
                self.away = QuantizedRegion.encoding(self.shard, block_size=plan.wire_block)
                moved = place(plan.shard_at, self.away.codes(), space, pin=plan.pin_memory)
                if moved is not None:
                    self.away = QuantizedRegion(moved, layout.shard_numel, plan.wire_block)
            else:
                self.away = place(plan.shard_at, self.shard, space, pin=plan.pin_memory)
            if n == 1 and not plan.gathered_copy:
                self.full = self.shard
        self.leaves = [self._leaf(bucket) for bucket in layout.buckets]
        self.master: torch.Tensor | None = None
        self.master_file: FileRegion | None = None
        if plan.separate_master:
            master = torch.zeros(layout.shard_numel, dtype=plan.master_dtype, device=device)
            self._copy_pieces(self._flatten(originals, plan.master_dtype, device), master)
            space = (spaces.optimizer if plan.trainable else spaces.parameters) if spaces else None
            region = place(plan.master_at, master, space, pin=plan.pin_memory)
            if isinstance(region, FileRegion):
                self.master_file = region
            else:
                self.master = region.tensor if isinstance(region, HostRegion) else master
        self.params = [self._sharded_param(i) for i in range(len(refs))]
        self.state = GatherState.UNSHARDED
        self._gather: Pending | None = None
        self.secondary: torch.Tensor | None = None
        if sharded and self.full is not self.shard or self.away is not None:
            self._free_full()
        if self.away is not None and self.shard is not None:
            release(self.shard)
        # Gradient state.
        self.grad_store: torch.Tensor | None = None
        self.defer_store = False
        """Make a freed gradient store at its first reduction (``store``), not when the window opens:
        DeepSpeed's stages 1-2 make their gradient partition at its first gradient, and the
        DeepSpeed memory model (``planning/deepspeed_memory.py``) sets this to hold it as late."""
        self.local_acc: torch.Tensor | None = None
        self.store_is_accumulator = False
        self.accumulated = [False] * len(layout.buckets)
        self.used = [False] * len(refs)
        """Which parameters got a gradient in this accumulation window, on this rank: plain flags set by a
        gradient hook (no tensor op per parameter per backward); ``Engine._close_window`` sends them once."""
        self.optimizer_grads: torch.Tensor | None = None
        self._grad_views: tuple[torch.Tensor | None, list[torch.Tensor]] = (None, [])
        """(the grad store they view, each parameter's gradient as a view of it): made once, not per step."""
        self.handed: list[bool] = []
        """Used parameters at the last boundary (who gets an optimizer gradient, ``grad_store.py``)."""
        self.pending = False
        """Deferred gradients no step has consumed yet (``deferred_grads``)."""

    @property
    def master_device(self) -> torch.device:
        """Where the optimizer sees the stepped elements (and wants their gradients)."""
        if self.plan.separate_master and self.plan.master_at.home is not Home.DEVICE:
            return torch.device("cpu")
        return self.full.device

    @property
    def deferred_grads(self) -> bool:
        """The optimizer's gradients differ in dtype from the store: they are cast from it
        at step time and dropped after the step, never kept beside it (``grad_store.py``)."""
        return self.plan.accumulate_dtype != self.plan.master_dtype and self.master_device == self.full.device

    @property
    def values_away(self) -> bool:
        """The master values are not in memory: the sharded parameters are placeholders."""
        return self.master_file is not None or (not self.plan.separate_master and self.away is not None)

    # ------------------------------------------------------------------ layout helpers

    def _flatten(self, originals: list[nn.Parameter], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The originals in the full flat layout (padding zero) in ``dtype``; zeros for meta ones."""
        full = torch.zeros(self.layout.numel, dtype=dtype, device=device)
        if originals[0].is_meta:
            return full
        for original, offset in zip(originals, self.layout.offsets):
            flat = original.detach().reshape(-1)
            full[offset:offset + flat.numel()].copy_(flat)
        return full

    def _copy_pieces(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        for b in self.layout.buckets:
            shard[b.in_shard].copy_(full[b.piece_of(self.layout.shard_rank)])

    def _leaf(self, bucket: BucketLayout) -> torch.Tensor:
        leaf = torch.empty(0, dtype=self.plan.compute_dtype, device=self.full.device)
        leaf.set_(self.full.untyped_storage(), self.full.storage_offset() + bucket.offset, (bucket.numel,), (1,))
        if self.plan.trainable:
            leaf.requires_grad_(True)
        return leaf

    def master_view(self, i: int) -> torch.Tensor:
        """This rank's run of parameter ``i`` in the master elements."""
        piece = self.layout.pieces[i]
        if self.master is not None:
            return self.master[piece.shard_start:piece.shard_stop]
        if self.shard is not None:
            return self.shard[piece.shard_start:piece.shard_stop]
        return self.full[piece.full_start:piece.full_start + piece.numel]

    def param_shape(self, i: int) -> torch.Size:
        """Shape of sharded parameter ``i``: the original with one shard, else its run."""
        return self.refs[i].shape if self.layout.shards == 1 else torch.Size([self.layout.pieces[i].numel])

    def placeholder(self, i: int) -> torch.Tensor:
        dtype = self.plan.master_dtype if self.plan.separate_master else self.plan.shard_dtype
        return placeholder(self.param_shape(i), dtype, self.master_device)

    def _sharded_param(self, i: int) -> nn.Parameter:
        view = self.placeholder(i) if self.values_away else self.master_view(i).view(self.param_shape(i))
        return nn.Parameter(view, requires_grad=self.plan.trainable)

    # ------------------------------------------------------------------ gather / free

    def _free_full(self) -> None:
        release(self.full)
        self.state = GatherState.SHARDED

    def unshard(self, *, backward: bool, async_op: bool = True) -> None:
        """Issue the all-gather of ``full`` unless it is there (``async_op``: as a collective
        in flight; else ordered on the current stream, a side stream on CUDA)."""
        if self.state is not GatherState.SHARDED:
            return
        reserve(self.full)
        if backward and self.secondary is not None:
            self._gather = collectives.all_gather(self.full, self.secondary, self.mesh.secondary, self.stats,
                                                  async_op=async_op)
        else:
            assert self.shard is not None
            if self.away is not None:  # read the shard in; it is let go once gathered
                reserve(self.shard)
                self.away.read(0, self.shard)
            if self.plan.param_wire is not WireFormat.FULL and self.layout.shards > 1:
                # quantized on the wire: encoded from the shard as it is, decoded into the compute dtype
                self._gather = all_gather_encoded(self.full, self.shard, self.plan.param_wire, self.plan.wire_block,
                                                  self.mesh.gather, self.stats, async_op=async_op)
                self.state = GatherState.GATHERING
                return
            source = self.shard if self.shard.dtype == self.full.dtype or self.layout.shards == 1 else \
                self.shard.to(self.full.dtype)  # the gathered layout's cast, freed once gathered
            self._gather = collectives.all_gather(self.full, source, self.mesh.gather, self.stats, async_op=async_op)
        self.state = GatherState.GATHERING

    def wait_unshard(self) -> None:
        """Block until ``full`` holds the gathered parameters."""
        if self.state is GatherState.GATHERING:
            assert self._gather is not None
            self._gather.wait()
            self._gather = None
            self.state = GatherState.UNSHARDED
            if self.away is not None and self.shard is not None and self.shard is not self.full:
                release(self.shard)

    def reshard(self, *, keep_secondary: bool) -> None:
        """Free ``full`` (sharded groups); with hpZ keep the secondary shard."""
        if not keep_secondary:
            self.secondary = None
        if not self.plan.sharding.sharded_at_rest or (self.full is self.shard and self.away is None):
            return
        self.wait_unshard()
        if self.state is not GatherState.UNSHARDED:
            return
        if keep_secondary and self.plan.keep_secondary and self.mesh.secondary_size < self.layout.shards:
            size = self.layout.numel // self.mesh.secondary_size
            j = self.mesh.secondary_rank
            self.secondary = self.full[j * size:(j + 1) * size].clone()
        self._free_full()

    @property
    def gathered_numel(self) -> int:
        """Elements of ``full`` resident now beyond the shard."""
        return self.layout.numel if self.state is not GatherState.SHARDED and self.full is not self.shard else 0

    # ------------------------------------------------------------------ gradients

    def begin_window(self, *, single_reduce: bool) -> None:
        """Start an accumulation window: gradients the user cleared start from zero.

        ``single_reduce``: the window reduces once, at its end, so a replicated
        store can accumulate locally and be reduced in place."""
        self.accumulated = [False] * len(self.layout.buckets)
        self.used = [False] * len(self.refs)
        cleared = [p.grad is None and not self.pending for p in self.params]
        if self.grad_store is None:
            if not self.defer_store:
                self.store()
        elif all(cleared):
            self.grad_store.zero_()
        else:
            for i, was_cleared in enumerate(cleared):
                if was_cleared:
                    self.store_view(i).zero_()
        self.store_is_accumulator = single_reduce and not self.plan.shard_grads and all(cleared)

    def store(self) -> torch.Tensor:
        """The gradient store, made (zeroed) when there is none."""
        if self.grad_store is None:
            size = self.layout.shard_numel if self.plan.shard_grads else self.layout.numel
            self.grad_store = torch.zeros(size, dtype=self.plan.accumulate_dtype, device=self.full.device)
        return self.grad_store

    def release_grads(self) -> None:
        """Free the gradient store between steps (``begin_window`` makes it again, zeroed). The
        parameters' gradients must be cleared first: a view of the store would keep it alive."""
        self.grad_store = None
        self._grad_views = (None, [])

    def accumulator(self) -> torch.Tensor:
        if self.store_is_accumulator:
            return self.store()
        if self.local_acc is None:
            self.local_acc = torch.zeros(self.layout.numel, dtype=self.plan.accumulate_dtype, device=self.full.device)
        return self.local_acc

    def take_grad(self, b: int) -> torch.Tensor | None:
        grad = self.leaves[b].grad
        self.leaves[b].grad = None
        return grad

    def accumulate_local(self, b: int) -> None:
        """No-sync micro-step: add the bucket's gradient into the local accumulator."""
        grad = self.take_grad(b)
        if grad is None:
            return
        self.accumulator()[self.layout.buckets[b].region].add_(grad)
        self.accumulated[b] = True

    def end_window(self) -> None:
        """After the reductions landed: drop the no-sync accumulator."""
        self.local_acc = None

    def grad_views(self) -> list[torch.Tensor]:
        """Each parameter's gradient in the shape of its parameter, viewing ``grad_store``; made once
        per store (the store lives as long as the group), so a step creates no views."""
        store, views = self._grad_views
        if store is not self.grad_store:
            views = [self.store_view(i).view(param.shape) for i, param in enumerate(self.params)]
            self._grad_views = (self.grad_store, views)
        return views

    def store_view(self, i: int) -> torch.Tensor:
        piece = self.layout.pieces[i]
        assert self.grad_store is not None
        if self.plan.shard_grads:
            return self.grad_store[piece.shard_start:piece.shard_stop]
        return self.grad_store[piece.full_start:piece.full_start + piece.numel]

    # ------------------------------------------------------------------ after the step

    def after_step(self) -> Iterator[tuple[int, Pending]]:
        """Once the stepped values are in the compute parameters (``master.push_master``) and
        the optimizer's gradients dropped (``grad_store.drop_grads``): drop the hpZ shard; replicated
        groups all-gather the updated pieces in place, yielding each gather in flight with its
        element count (the caller bounds how many are in flight)."""
        r = self.layout.shard_rank
        self.secondary = None
        if self.shard is not None or self.layout.shards == 1:
            return
        for b in self.layout.buckets:
            yield b.numel, collectives.all_gather(self.full[b.region], self.full[b.piece_of(r)], self.mesh.gather,
                                                  self.stats, async_op=True)
