"""The built-in TinyGPT and synthetic token data: sizes, determinism, learnability."""

from __future__ import annotations

import sys

import pytest
import torch

import zerobridge.models  # noqa: F401  (loads the submodules into sys.modules)
from zerobridge.models import PRESETS, GPTConfig, SyntheticTokens, TinyGPT, count_params, preset_table, shard, tiny_gpt

TINY_GPT_MODULE = sys.modules["zerobridge.models.tiny_gpt"]


def _manual_count(config: GPTConfig) -> int:
    """Parameter count written out layer by layer, independent of ``count_params``."""
    e, v, h = config.n_embd, config.vocab_size, config.mlp_ratio * config.n_embd
    per_block = (2 * e) + (e * e + e) + (e * e) + (e * e + e) + (e * e + e) + (2 * e) + (e * h + h) + (h * e + e)
    head = 0 if config.tie_embeddings else v * e
    return v * e + config.block_size * e + config.n_layer * per_block + 2 * e + head


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_parameter_counts_match_the_documented_table(preset: str) -> None:
    model = tiny_gpt(preset, device="meta")  # shapes only; nothing allocated
    assert model.num_params() == count_params(PRESETS[preset]) == _manual_count(PRESETS[preset])
    assert f"{model.num_params():,}" in TINY_GPT_MODULE.__doc__


def test_preset_sizes_are_what_their_names_say() -> None:
    counts = {name: count_params(config) for name, config in PRESETS.items()}
    assert 100_000 <= counts["tiny"] <= 200_000
    assert abs(counts["20m"] - 20e6) / 20e6 < 0.1
    assert abs(counts["100m"] - 100e6) / 100e6 < 0.1


def test_docstring_table_is_current() -> None:
    documented = "\n".join(line.strip() for line in TINY_GPT_MODULE.__doc__.splitlines())
    assert preset_table() in documented, "update the table in zerobridge/models/tiny_gpt.py from preset_table()"


def test_untied_head_counts_separately() -> None:
    model = tiny_gpt("tiny", tie_embeddings=False)
    assert model.lm_head.weight is not model.wte.weight
    assert model.num_params() == count_params(model.config) == _manual_count(model.config)


def test_same_seed_same_weights_regardless_of_global_rng() -> None:
    torch.manual_seed(123)
    a = tiny_gpt("tiny", seed=7).state_dict()
    torch.manual_seed(999)
    torch.rand(1000)
    state = torch.random.get_rng_state()
    b = tiny_gpt("tiny", seed=7).state_dict()
    assert torch.equal(state, torch.random.get_rng_state()), "building a model must not consume the global RNG"
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = tiny_gpt("tiny", seed=8).state_dict()
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("weight") and "ln" not in k)


def test_init_values() -> None:
    model = tiny_gpt("tiny", seed=0)
    assert model.blocks[0].attn.k.bias is None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0), name
        elif isinstance(module, torch.nn.Linear) and module.bias is not None:
            assert torch.all(module.bias == 0), name
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    assert TinyGPT._no_split_modules == ["Block"]


def test_tied_weights_are_one_parameter() -> None:
    model = tiny_gpt("tiny")
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.bias is None
    assert sum(1 for _ in model.parameters()) == len({id(p) for p in model.parameters()})


def test_forward_shapes_and_finite_loss() -> None:
    model = tiny_gpt("tiny")
    data = SyntheticTokens(model.config.vocab_size, seq_len=model.config.block_size)
    x, y = data.batch(0, 3)
    logits = model(x)
    assert logits.shape == (3, model.config.block_size, model.config.vocab_size)
    loss = model(x, y)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - data.uniform_loss()) < 0.2  # untrained: close to ln(vocab)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ValueError, match="tiny.*20m.*100m"):
        tiny_gpt("huge")
    with pytest.raises(ValueError, match="n_embd"):
        tiny_gpt("tiny", n_embd=65)  # not divisible by n_head
    with pytest.raises(ValueError, match="GPTConfig fields"):
        tiny_gpt("tiny", dropout=0.1)


def test_loss_decreases_with_adamw() -> None:
    model = tiny_gpt("tiny", seed=0)
    data = SyntheticTokens(model.config.vocab_size, seq_len=model.config.block_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        x, y = data.batch(step, 16)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_batches_are_deterministic_per_step() -> None:
    data = SyntheticTokens(64, 12, seed=5)
    x, y = data.batch(4, 8)
    assert x.shape == y.shape == (8, 12) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < 64
    again = SyntheticTokens(64, 12, seed=5).batch(4, 8)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, data.batch(5, 8)[0])
    assert not torch.equal(x, SyntheticTokens(64, 12, seed=6).batch(4, 8)[0])


def test_batches_follow_the_chain() -> None:
    data = SyntheticTokens(64, 12, seed=1)
    x, y = data.batch(0, 32)
    allowed = data.next_tokens[x]  # [B, T, successors]
    assert bool((allowed == y.unsqueeze(-1)).any(-1).all())


def test_shards_concatenate_back() -> None:
    x, _ = SyntheticTokens(32, 8).batch(0, 12)
    for world in (1, 2, 3, 4):
        assert torch.equal(torch.cat([shard(x, r, world) for r in range(world)]), x)
    with pytest.raises(ValueError, match="not divisible"):
        shard(x, 0, 5)
    with pytest.raises(ValueError, match="rank"):
        shard(x, 2, 2)


def test_transition_table_is_drawn_in_blocks_with_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of rows draw the numbers one vocab x vocab draw would (the data never changes with the block
    size), so a large vocabulary never materialises the whole table."""
    import zerobridge.models.data as data

    g = torch.Generator().manual_seed(data._mix(7, -1))
    whole = torch.argsort(torch.rand(300, 300, generator=g), dim=1)[:, :4]
    monkeypatch.setattr(data, "_BLOCK_ELEMENTS", 300 * 7)  # 7 rows per block, the last block short
    assert torch.equal(SyntheticTokens(300, 8, seed=7).next_tokens, whole)


def test_large_vocabulary_stays_small_in_memory() -> None:
    """Vocab 16384 (the 100m preset): the peak while building stays far below the 3 GiB of a whole table."""
    import subprocess

    code = ("import resource, torch\n"
            "from zerobridge.models.data import SyntheticTokens\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "SyntheticTokens(16384, 16, seed=0)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    grown_kib = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert grown_kib < 400 * 1024
