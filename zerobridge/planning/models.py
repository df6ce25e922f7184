"""What ``zerobridge plan`` is asked about: a model users already have, built on the meta device.

    >>> from zerobridge.planning.models import resolve_model
    >>> source = resolve_model("tiny-gpt:20m")
    >>> source.name, source.layers, source.params
    ('tiny-gpt:20m', 6, 20091904)
    >>> next(source.build().parameters()).device.type
    'meta'
    >>> resolve_model("llama-3-70b").params
    70553706496

``MODEL`` is one of:

- a built-in model: ``tiny-gpt``, ``tiny-gpt:20m``, ``tiny-gpt:100m`` (zerobridge's
  own GPT), or a published shape (``SHAPES``: ``llama-3-8b``, ``llama-3-70b``,
  ``llama-3-405b``, ``mixtral-8x7b``, ``tiny-llama``), built as the Hugging Face
  model of that configuration;
- a Hugging Face ``config.json``, or a model directory holding one: only the
  configuration is read, never weights;
- ``pkg.module:factory``: a callable returning an ``nn.Module`` whose
  ``forward(input_ids, labels)`` returns the loss (or an output with ``.loss``).
  It is called under ``torch.device("meta")``.

Nothing is materialized: the model is built on the meta device and the plan
runs it on fake tensors. ``layers`` is the number of repeated blocks when the
source can be built at another depth (the planner measures two shallow
depths and extends the line to the full one); ``None`` for a factory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zerobridge.errors import ConfigError
from zerobridge.models import PRESETS, REFERENCE, TinyGPT, preset_named
from zerobridge.models.tiny_gpt import GPTConfig
from zerobridge.references import resolve_callable

__all__ = ["SHAPES", "ModelSource", "resolve_model"]


SHAPES: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096,
                   "max_position_embeddings": 1024, "tie_word_embeddings": False},
    "llama-3-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False},
    "llama-3-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                    "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False},
    "llama-3-405b": {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
                     "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                     "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
                     "tie_word_embeddings": False},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "rope_theta": 1e6, "tie_word_embeddings": False},
}
"""Published architectures by name: the shape of the Hugging Face ``config.json`` (no weights)."""


@dataclass(frozen=True)
class ModelSource:
    """A model to plan for: how to build it on meta (at its own depth or another) and feed it."""

    name: str
    builder: Callable[[int | None], nn.Module]
    """``builder(layers)``: the model on the meta device, ``layers`` blocks deep (``None``: its own depth)."""
    layers: int | None
    """Its repeated blocks, when it can be built at another depth."""
    vocab_size: int
    max_seq_len: int | None
    hf: bool
    """A Hugging Face model: called as ``model(input_ids=, labels=).loss``."""

    def build(self, layers: int | None = None) -> nn.Module:
        """The model on the meta device (``layers`` deep when given)."""
        with torch.device("meta"):
            return self.builder(layers)

    @property
    def params(self) -> int:
        """Parameters of the full model (tied tensors once)."""
        return sum(p.numel() for p in self.build().parameters())

    def loss(self, model: nn.Module, tokens: Tensor) -> Tensor:
        """The next-token loss on ``tokens`` (labels = inputs, as causal LMs take them)."""
        out = model(input_ids=tokens, labels=tokens) if self.hf else model(tokens, tokens)
        loss = getattr(out, "loss", out)
        if not isinstance(loss, Tensor):
            raise ConfigError(f"{self.name}'s forward returned {type(out).__name__}, not a loss", key="MODEL",
                              fix="make forward(input_ids, labels) return the loss tensor or an output with .loss")
        return loss


def _gpt(preset: str) -> ModelSource:
    base = PRESETS[preset]

    def build(layers: int | None) -> nn.Module:
        config = base if layers is None else GPTConfig(**{**base.__dict__, "n_layer": layers})
        return TinyGPT(config, device="meta")

    name = REFERENCE if preset == "tiny" else f"{REFERENCE}:{preset}"
    return ModelSource(name, build, base.n_layer, base.vocab_size, base.block_size, hf=False)


def _hf(name: str, config_dict: dict[str, Any], where: str) -> ModelSource:
    try:
        import transformers  # lazy: only Hugging Face sources need it
    except ImportError:
        raise ConfigError(f"{where} is a Hugging Face config, and transformers is not installed", key="MODEL",
                          fix="pip install transformers") from None
    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{where} has no \"model_type\"", key="model_type",
                          fix="use the model's own config.json (it names its model_type, e.g. \"llama\")")
    try:
        config = transformers.AutoConfig.for_model(**config_dict)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: transformers.AutoConfig does not know model_type {model_type!r} ({exc})",
                          key="model_type", fix="upgrade transformers, or pass the model as pkg.module:factory"
                          ) from None
    auto = transformers.AutoModelForCausalLM
    if type(config) not in auto._model_mapping:
        archs = ", ".join(config_dict.get("architectures") or []) or "none named"
        raise ConfigError(f"{where}: transformers.AutoModelForCausalLM has no class for model_type {model_type!r} "
                          f"(architectures: {archs})", key="model_type",
                          fix="plan a causal language model, or pass the model as pkg.module:factory")
    depth_key = "num_hidden_layers"
    layers = getattr(config, depth_key, None)

    def build(depth: int | None) -> nn.Module:
        made = config if depth is None else transformers.AutoConfig.for_model(**{**config_dict, depth_key: depth})
        return auto.from_config(made, dtype=torch.float32)

    return ModelSource(name, build, layers if isinstance(layers, int) else None, int(config.vocab_size),
                       getattr(config, "max_position_embeddings", None), hf=True)


def _factory(ref: str) -> ModelSource:
    factory = resolve_callable(ref, key="MODEL", wants="a function that returns the nn.Module to plan for")

    def build(depth: int | None) -> nn.Module:
        made = factory()
        if not isinstance(made, nn.Module):
            raise ConfigError(f"{ref}() returned {type(made).__name__}, not an nn.Module", key="MODEL",
                              fix="return the model (it is called under torch.device('meta'))")
        return made

    return ModelSource(ref, build, None, vocab_size=0, max_seq_len=None, hf=False)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", key="MODEL", fix="check the path") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc.msg}", key="MODEL", line=exc.lineno,
                          fix="give the model's config.json (or the directory that holds it)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a {type(data).__name__}, not a config object", key="MODEL",
                          fix="give the model's config.json")
    return data


def resolve_model(ref: str) -> ModelSource:
    """The model ``ref`` names (module docstring); ``ConfigError`` naming the fix otherwise."""
    preset = preset_named(ref, key="MODEL")
    if preset is not None:
        return _gpt(preset)
    if ref in SHAPES:
        return _hf(ref, SHAPES[ref], f"the built-in shape {ref}")
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{ref} is a directory without a config.json", key="MODEL",
                              fix="point at the model directory that holds config.json, or at the file")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ConfigError(f"{path} does not exist", key="MODEL", fix="check the path")
        return _hf(str(path), _read_config(path), str(path))
    head, sep, tail = ref.partition(":")
    if sep and head and tail:
        return _factory(ref)
    names = ", ".join([REFERENCE, *(f"{REFERENCE}:{p}" for p in PRESETS if p != "tiny"), *SHAPES])
    raise ConfigError(f"MODEL {ref!r} is not a built-in model, a config.json, a model directory or "
                      "pkg.module:factory", key="MODEL", fix=f"use one of {names}, or a path to config.json")
