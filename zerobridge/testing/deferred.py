"""Models built on the meta device and prepared on every rank, for the deferred-init tests.

    >>> import torch
    >>> from zerobridge.testing.deferred import eager_state
    >>> sorted(eager_state("mixed"))[:3]
    ['attn.in_proj_bias', 'attn.in_proj_weight', 'attn.out_proj.bias']

``meta_state`` runs on every rank of a ``Cluster``: it seeds the generator,
builds a model under ``torch.device("meta")``, prepares it (native engine or a
backend) and returns its full state; ``eager_state`` builds the same model
eagerly in one process. Equal states prove the replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerobridge
from zerobridge.compare.worker import peak_rss_bytes, reset_peak_rss, rss_bytes
from zerobridge.testing.parity import ParityNet

__all__ = ["BUILDERS", "MixedNet", "eager_state", "exact_rss", "load_peak", "load_state", "meta_state", "prepare_peak",
           "save_checkpoint_of", "scale_init"]


class Scaled(nn.Module):
    """A bare parameter made in the constructor: no ``reset_parameters`` covers it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class MixedNet(nn.Module):
    """Torch modules that initialize themselves: attention (which resets a child),
    conv, norms with buffers, a tied head, a frozen and an unused layer; with
    ``bare=True`` also a parameter only ``init_fn`` can initialize (and no
    attention: an ``init_fn`` writes only its module's own tensors, so it cannot
    replay how attention zeroes its child's bias)."""

    def __init__(self, bare: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.attn = None if bare else nn.MultiheadAttention(8, 2)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(5, 3)
        self.norm = nn.LayerNorm(8)
        self.scaled = Scaled(8) if bare else None
        self.head = nn.Linear(8, 11, bias=True)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.attn is not None:
            x = x + self.attn(x, x, x, need_weights=False)[0]
        x = x + self.bn(self.conv(x.transpose(1, 2))).transpose(1, 2)
        x = x + self.frozen(x)
        if self.scaled is not None:
            x = self.scaled(x)
        return self.head(self.norm(x))


def scale_init(module: nn.Module) -> None:
    """An ``init_fn``: the modules' own resets, and ones for ``Scaled`` (as its constructor)."""
    if isinstance(module, Scaled):
        nn.init.ones_(module.gain)
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


def _llama() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


def _gpt2() -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def _parity() -> nn.Module:
    return ParityNet(0)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "mixed": MixedNet,
    "bare": lambda: MixedNet(bare=True),
    "parity": _parity,
    "llama": _llama,
    "gpt2": _gpt2,
}
INIT_FNS: dict[str, Callable[[nn.Module], None]] = {"scale_init": scale_init}


def eager_state(model: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The state of ``model`` built eagerly from ``seed`` in this process."""
    torch.manual_seed(seed)
    built = BUILDERS[model]()
    return {k: v.detach().clone() for k, v in built.state_dict().items()}


def meta_state(*, model: str, seed: int = 0, stage: int | None = None, spec: Any = None, backend: str | None = None,
               init_fn: str | None = None, rank_seed: bool = False) -> dict[str, Any]:
    """On every rank: build ``model`` on meta from ``seed`` (``rank_seed``: ``seed +
    rank``), prepare it, and return its full state and the generator state after."""

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(seed + (rank if rank_seed else 0))
    with torch.device("meta"):
        built = BUILDERS[model]()
    prepared = zerobridge.prepare(built, stage=stage, config=spec, backend=backend,
                                  init_fn=INIT_FNS[init_fn] if init_fn else None)
    state = {k: v.detach().cpu().clone() for k, v in zerobridge.full_state_dict(prepared).items()}
    return {"state": state, "rng": torch.get_rng_state()}


def exact_rss() -> None:
    """Make glibc return every large block to the system when it is freed (a fixed
    mmap threshold), so resident-set figures track live tensors."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, not raised after frees
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD


def _stack(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def prepare_peak(*, layers: int, width: int, stage: int = 3) -> dict[str, int]:
    """On every rank: the rise of the resident set's high-water mark while building and
    preparing a stack of ``layers`` square Linear layers, meta-built then eager."""
    import gc


    exact_rss()
    rises = {}
    for path in ("meta", "eager"):
        gc.collect()
        reset_peak_rss()
        base = rss_bytes()
        torch.manual_seed(0)
        if path == "meta":
            with torch.device("meta"):
                model = _stack(layers, width)
        else:
            model = _stack(layers, width)
        model = zerobridge.prepare(model, stage=stage)
        rises[path] = peak_rss_bytes() - base
        del model
    return rises


def load_state(*, model: str, source: str, stage: int | None = None, spec: Any = None, backend: str | None = None,
               strict: bool = True) -> dict[str, Any]:
    """On every rank: build ``model`` on meta, prepare it, ``load_pretrained(source)``;
    the full state and what this rank read."""

    torch.manual_seed(0)
    with torch.device("meta"):
        built = BUILDERS[model]()
    prepared = zerobridge.prepare(built, stage=stage, config=spec, backend=backend)
    report = zerobridge.load_pretrained(prepared, source, strict=strict)
    state = {k: v.detach().cpu().clone() for k, v in zerobridge.full_state_dict(prepared).items()}
    return {"state": state, "bytes_read": report.bytes_read, "missing": report.missing,
            "unexpected": report.unexpected, "renamed": report.renamed}


def save_checkpoint_of(*, model: str, path: str, seed: int = 1, stage: int = 3) -> None:
    """On every rank: an eager ``model`` from ``seed``, prepared at ``stage`` and saved
    with ``zerobridge.save_checkpoint`` to ``path``."""

    torch.manual_seed(seed)
    prepared = zerobridge.prepare(BUILDERS[model](), stage=stage)
    zerobridge.save_checkpoint(path, prepared)


def load_peak(*, layers: int, width: int, source: str, stage: int = 3) -> dict[str, int]:
    """On every rank: the high-water rise of the resident set over meta build, prepare
    and ``load_pretrained`` of a square Linear stack, and the bytes read."""
    import gc


    exact_rss()
    gc.collect()
    reset_peak_rss()
    base = rss_bytes()
    with torch.device("meta"):
        model = _stack(layers, width)
    model = zerobridge.prepare(model, stage=stage)
    report = zerobridge.load_pretrained(model, source)
    return {"rise": peak_rss_bytes() - base, "bytes_read": report.bytes_read}
