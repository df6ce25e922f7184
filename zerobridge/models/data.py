"""Synthetic, learnable, deterministic token batches for training tests.

    >>> import torch
    >>> from zerobridge.models.data import SyntheticTokens, shard
    >>> data = SyntheticTokens(vocab_size=256, seq_len=16, seed=0)
    >>> x, y = data.batch(step=3, batch_size=4)
    >>> tuple(x.shape), bool(torch.equal(x[:, 1:], y[:, :-1]))
    ((4, 16), True)
    >>> torch.equal(data.batch(3, 4)[0], x)
    True
    >>> tuple(shard(x, rank=1, world_size=2).shape)
    (2, 16)

Sequences are walks on a fixed random first-order Markov chain: each token
has a handful of likely successors, so a model's loss falls well below the
uniform ``ln(vocab)`` within a few dozen steps. A batch depends only on the
seed, the step and the batch size, so every rank (and every strategy) can
draw the same global batch and take its own ``shard``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["SyntheticTokens", "shard"]

_MASK64 = (1 << 64) - 1
_BLOCK_ELEMENTS = 1 << 22  # random draws per block of transition-table rows


def _mix(seed: int, step: int) -> int:
    """A well-spread 63-bit generator seed from ``(seed, step)`` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class SyntheticTokens:
    """Token sequences from a seeded random Markov chain over ``vocab_size`` tokens.

    Each row of the transition table puts all its mass on ``successors`` next
    tokens with geometrically falling probabilities (about 0.53, 0.27, 0.13,
    0.07 for four), so the best achievable loss is about 1.14 nats against
    ``ln(vocab_size)`` for a model that has learnt nothing.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int = 0, successors: int = 4) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 1 <= successors <= vocab_size:
            raise ValueError(f"successors must be in [1, vocab_size={vocab_size}], got {successors}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        g = torch.Generator().manual_seed(_mix(seed, -1))
        # Distinct successors per row: the first `successors` of a random permutation. Rows are
        # drawn in blocks (the same numbers as one vocab x vocab draw) so that a large vocabulary
        # never holds the whole permutation table: 3 GiB at vocab 16384.
        rows = max(1, _BLOCK_ELEMENTS // vocab_size)
        self.next_tokens: Tensor = torch.cat([
            torch.argsort(torch.rand(min(rows, vocab_size - start), vocab_size, generator=g), dim=1)[:, :successors]
            .clone()
            for start in range(0, vocab_size, rows)])
        weights = 0.5 ** torch.arange(successors, dtype=torch.float64)
        self.next_probs: Tensor = (weights / weights.sum()).expand(vocab_size, successors).contiguous()

    def entropy(self) -> float:
        """Per-token entropy of the chain in nats: the loss a perfect model reaches."""
        p = self.next_probs[0]
        return float(-(p * p.log()).sum())

    def uniform_loss(self) -> float:
        """Loss of a model that predicts every token with equal probability."""
        return math.log(self.vocab_size)

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """``(x, y)``, both ``[batch_size, seq_len]`` int64, with ``y`` = ``x`` shifted by one."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        # One uniform draw per position picks the successor by inverse CDF.
        cdf = self.next_probs[0].cumsum(0)
        picks = torch.searchsorted(cdf, torch.rand(batch_size, self.seq_len, generator=g, dtype=torch.float64))
        picks = picks.clamp_(max=cdf.numel() - 1)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.next_tokens[tokens[:, t], picks[:, t]]
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def shard(x: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s contiguous slice of ``x`` along the batch dimension."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if x.dim() == 0:
        raise ValueError("cannot shard a 0-d tensor: it has no batch dimension")
    n = x.shape[0]
    if n % world_size:
        raise ValueError(f"batch size {n} is not divisible by world_size {world_size}; "
                         f"use a batch size that is a multiple of {world_size}")
    per_rank = n // world_size
    return x[rank * per_rank:(rank + 1) * per_rank]
