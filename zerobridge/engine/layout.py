"""Where each parameter's elements live in a flat group, in full and in shards.

    >>> from zerobridge.engine.layout import plan_layout
    >>> layout = plan_layout([6, 3, 5], shards=2, shard_rank=1, bucket_cap=8)
    >>> [(b.offset, b.numel, b.data_numel) for b in layout.buckets]
    [(0, 6, 6), (6, 8, 8)]
    >>> [(p.shard_start, p.shard_stop, p.param_start) for p in layout.pieces]
    [(0, 3, 3), (3, 3, 4), (3, 7, 1)]

A flat group concatenates its parameters into buckets. Each bucket is padded
to a multiple of the shard count ``N`` and split into ``N`` equal pieces;
rank ``r`` owns piece ``r`` of every bucket, so its shard is the
concatenation of its pieces. A parameter never straddles two buckets, so the
part of it a rank owns is one contiguous run in the full buffer and in the
shard alike. Pure arithmetic: no tensors, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BucketLayout", "GroupLayout", "LocalPiece", "plan_layout"]


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: a unit of reduction (and, replicated, of the post-step gather)."""

    index: int
    offset: int
    """First element in the group's full flat buffer."""
    numel: int
    """Elements including padding (a multiple of N)."""
    data_numel: int
    """Elements of parameters, without padding."""
    params: range
    """Positions of its parameters in the group."""
    piece: int
    """Elements per rank (numel / N)."""

    @property
    def shard_offset(self) -> int:
        """First element of this bucket's piece in a rank's shard."""
        return self.offset // (self.numel // self.piece)

    @property
    def region(self) -> slice:
        """The whole bucket in the group's full flat buffer."""
        return slice(self.offset, self.offset + self.numel)

    @property
    def in_shard(self) -> slice:
        """This bucket's piece in a rank's shard."""
        return slice(self.shard_offset, self.shard_offset + self.piece)

    def piece_of(self, rank: int) -> slice:
        """Rank ``rank``'s piece in the full flat buffer."""
        start = self.offset + rank * self.piece
        return slice(start, start + self.piece)


@dataclass(frozen=True)
class LocalPiece:
    """The run of one parameter's elements this rank owns (maybe empty)."""

    shard_start: int
    shard_stop: int
    param_start: int
    """Offset of ``shard_start`` inside the flattened parameter."""
    full_start: int
    """Offset of ``shard_start`` in the group's full flat buffer."""

    @property
    def numel(self) -> int:
        return self.shard_stop - self.shard_start


@dataclass(frozen=True)
class GroupLayout:
    """The layout of every parameter of a flat group, for one rank."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    """Where each parameter starts in the full flat buffer."""
    buckets: tuple[BucketLayout, ...]
    pieces: tuple[LocalPiece, ...]
    shards: int
    shard_rank: int

    @property
    def numel(self) -> int:
        """Full flat elements, padding included."""
        last = self.buckets[-1]
        return last.offset + last.numel if self.buckets else 0

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard."""
        return self.numel // self.shards

    @property
    def padding(self) -> int:
        return self.numel - sum(self.numels)

    def bucket_of(self, param: int) -> BucketLayout:
        """The bucket that holds parameter ``param``."""
        for bucket in self.buckets:
            if param in bucket.params:
                return bucket
        raise IndexError(param)

    def split_sizes(self, bucket: BucketLayout) -> list[int]:
        """Sizes that cut a bucket's flat buffer into its parameters and the padding."""
        sizes = [self.numels[i] for i in bucket.params]
        return sizes + [bucket.numel - bucket.data_numel]


def plan_layout(numels: list[int] | tuple[int, ...], *, shards: int, shard_rank: int,
                bucket_cap: int | None) -> GroupLayout:
    """Lay out parameters of ``numels`` elements in buckets of at most ``bucket_cap``.

    A bucket closes before a parameter that would overflow it; a parameter
    larger than the cap gets a bucket of its own. ``None``: one bucket.
    """
    groups: list[list[int]] = []
    filled = 0
    for index, numel in enumerate(numels):
        if not groups or (bucket_cap is not None and filled and filled + numel > bucket_cap):
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += numel
    buckets: list[BucketLayout] = []
    offsets: list[int] = []
    cursor = 0
    for index, members in enumerate(groups):
        data = sum(numels[i] for i in members)
        padded = -(-max(data, 1) // shards) * shards
        start = cursor
        for i in members:
            offsets.append(cursor)
            cursor += numels[i]
        buckets.append(BucketLayout(index=index, offset=start, numel=padded, data_numel=data,
                                    params=range(members[0], members[-1] + 1), piece=padded // shards))
        cursor = start + padded
    pieces = []
    for index, numel in enumerate(numels):
        bucket = next(b for b in buckets if index in b.params)
        own_start = bucket.offset + shard_rank * bucket.piece
        start = max(offsets[index], own_start)
        stop = min(offsets[index] + numel, own_start + bucket.piece)
        if stop <= start:  # this rank owns none of it
            start = stop = own_start
        shard_start = bucket.shard_offset + (start - own_start)
        pieces.append(LocalPiece(shard_start=shard_start, shard_stop=shard_start + stop - start,
                                 param_start=start - offsets[index], full_start=start))
    return GroupLayout(numels=tuple(numels), offsets=tuple(offsets), buckets=tuple(buckets),
                       pieces=tuple(pieces), shards=shards, shard_rank=shard_rank)
