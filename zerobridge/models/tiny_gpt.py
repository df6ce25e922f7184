"""A small, deterministic GPT for exercising sharding strategies end to end.

    >>> import torch
    >>> from zerobridge.models.tiny_gpt import tiny_gpt
    >>> model = tiny_gpt("tiny", seed=0)
    >>> model.num_params()
    118400
    >>> idx = torch.zeros(2, 8, dtype=torch.long)
    >>> tuple(model(idx).shape)
    (2, 8, 256)
    >>> model(idx, targets=idx).item() > 0
    True

The model is a decoder-only transformer with pre-LayerNorm blocks, learned
position embeddings, an output head tied to the token embedding, and no
dropout: the same seed always gives bitwise the same weights, independent of
the global RNG, so two runs under different sharding strategies start from
the same point.

Presets (parameter counts as ``TinyGPT.num_params()`` reports them, tied
weights counted once; ``preset_table()`` regenerates this table):

    | preset | vocab | block | layers | heads | embd | parameters |
    |--------|-------|-------|--------|-------|------|------------|
    | tiny   |   256 |    32 |      2 |     2 |   64 |    118,400 |
    | 20m    |  2048 |   256 |      6 |     8 |  512 | 20,091,904 |
    | 100m   | 16384 |  1024 |     12 |    12 |  768 | 98,416,128 |

The attention key projection has no bias: softmax ignores a constant shift
of the scores, so a key bias always receives a zero true gradient, and
optimizers would then treat it differently depending on rounding noise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerobridge.errors import ConfigError

__all__ = ["no_weight_decay", "PRESETS", "REFERENCE", "preset_named",
           "Block", "CausalSelfAttention", "GPTConfig", "MLP", "TinyGPT", "count_params",
           "preset_table", "tiny_gpt"]

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a ``TinyGPT``. There is no dropout: the model is deterministic."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    mlp_ratio: int = 4
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64),
    "20m": GPTConfig(vocab_size=2048, block_size=256, n_layer=6, n_head=8, n_embd=512),
    "100m": GPTConfig(vocab_size=16384, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def count_params(config: GPTConfig) -> int:
    """Parameters of ``TinyGPT(config)`` from the shapes alone (no model built)."""
    e, hidden = config.n_embd, config.mlp_ratio * config.n_embd
    attention = 4 * e * e + 3 * e  # q, k, v, proj weights; biases on q, v, proj
    mlp = 2 * e * hidden + hidden + e
    block = attention + mlp + 4 * e  # plus two LayerNorms
    embeddings = config.vocab_size * e + config.block_size * e
    head = 0 if config.tie_embeddings else config.vocab_size * e
    return embeddings + config.n_layer * block + 2 * e + head


def preset_table() -> str:
    """The preset table of this module's docstring, computed from ``PRESETS``."""
    rows = ["| preset | vocab | block | layers | heads | embd | parameters |",
            "|--------|-------|-------|--------|-------|------|------------|"]
    for name, c in PRESETS.items():
        rows.append(f"| {name:<6} | {c.vocab_size:>5} | {c.block_size:>5} | {c.n_layer:>6} | {c.n_head:>5} "
                    f"| {c.n_embd:>4} | {count_params(c):>10,} |")
    return "\n".join(rows)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate q, k, v and output projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        e = config.n_embd
        self.n_head = config.n_head
        self.q = nn.Linear(e, e)
        self.k = nn.Linear(e, e, bias=False)  # a key bias has zero gradient (softmax shift invariance)
        self.v = nn.Linear(e, e)
        self.proj = nn.Linear(e, e)

    def forward(self, x: Tensor) -> Tensor:
        b, t, e = x.shape
        heads = (b, t, self.n_head, e // self.n_head)
        q, k, v = (layer(x).view(heads).transpose(1, 2) for layer in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, e))


class MLP(nn.Module):
    """Two Linear layers with a GELU between them."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer; ``TinyGPT(config, seed=s)`` is bitwise reproducible.

    ``device="meta"`` builds the shapes without initialising anything (for
    deferred initialisation; call ``init_weights`` after materialising).
    """

    _no_split_modules = ["Block"]  # Hugging Face convention: the transformer auto-wrap unit

    def __init__(self, config: GPTConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.seed = seed
        # Built on meta so construction neither spends time on default init nor
        # touches the global RNG; real storage is allocated below.
        with torch.device("meta"):
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.to_empty(device=device)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if torch.device(device).type != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter from ``seed`` (default: the constructor's).

        Values are drawn on the CPU from a private generator in module order, so
        the result is the same on every device and for every global RNG state.
        """
        generator = torch.Generator(device="cpu").manual_seed(self.seed if seed is None else seed)
        seen: set[int] = set()

        def fill_normal(weight: Tensor) -> None:
            if id(weight) in seen:
                return
            seen.add(id(weight))
            values = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=generator)
            weight.copy_(values)

        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                fill_normal(module.weight)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def num_params(self) -> int:
        """Parameter count with tied weights counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits ``[B, T, vocab]``, or the mean cross-entropy (fp32) when ``targets`` is given."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, time], got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


REFERENCE = "tiny-gpt"
"""How commands name this model: ``tiny-gpt`` (the ``tiny`` preset) or ``tiny-gpt:PRESET``."""


def preset_named(ref: str, *, key: str) -> str | None:
    """The preset ``ref`` names when it names this model (``tiny-gpt``, ``tiny-gpt:20m``), else
    ``None``; ``ConfigError`` at ``key`` for a preset that does not exist.

        >>> preset_named("tiny-gpt:20m", key="--model"), preset_named("tiny-gpt", key="--model")
        ('20m', 'tiny')
        >>> preset_named("pkg.mod:f", key="--model") is None
        True
    """
    head, sep, tail = ref.partition(":")
    if head != REFERENCE:
        return None
    preset = tail if sep else "tiny"
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} of the built-in model", key=key,
                          fix=f"use {REFERENCE}:" + f" or {REFERENCE}:".join(PRESETS))
    return preset


def tiny_gpt(preset: str = "tiny", *, seed: int = 0, **overrides: Any) -> TinyGPT:
    """A ``TinyGPT`` from a preset, with any ``GPTConfig`` field overridden.

    ``device`` may be passed among the overrides and goes to the constructor.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    device = overrides.pop("device", "cpu")
    try:
        config = replace(PRESETS[preset], **overrides)
    except TypeError as exc:
        fields = ", ".join(GPTConfig.__dataclass_fields__)
        raise ValueError(f"bad override for preset {preset!r} ({exc}); GPTConfig fields: {fields}") from None
    return TinyGPT(config, seed=seed, device=device)



def no_weight_decay(name: str) -> bool:
    """Whether a parameter of ``TinyGPT`` (by its name) is a bias or a LayerNorm
    weight: the usual group trained without weight decay. Names survive
    sharding, so this works on a prepared model too."""
    parts = name.split(".")
    return parts[-1] == "bias" or (len(parts) > 1 and parts[-2].startswith("ln"))
