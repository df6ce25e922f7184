"""Built-in models and data for running strategies end to end.

    >>> from zerobridge.models import SyntheticTokens, tiny_gpt
    >>> model = tiny_gpt("tiny", seed=0)
    >>> x, y = SyntheticTokens(model.config.vocab_size, seq_len=8).batch(step=0, batch_size=2)
    >>> model(x, targets=y).shape
    torch.Size([])
"""

from __future__ import annotations

from zerobridge.models.data import SyntheticTokens, shard
from zerobridge.models.tiny_gpt import (
    PRESETS,
    REFERENCE,
    Block,
    GPTConfig,
    TinyGPT,
    count_params,
    no_weight_decay,
    preset_named,
    preset_table,
    tiny_gpt,
)

__all__ = ["PRESETS", "REFERENCE", "Block", "GPTConfig", "SyntheticTokens", "TinyGPT", "count_params",
           "no_weight_decay",
           "preset_named", "preset_table", "shard", "tiny_gpt"]
