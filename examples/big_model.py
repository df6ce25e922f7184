"""Train a GPT too big for one rank: build it on the meta device, let zerobridge
materialize only each rank's shards, load pretrained weights rank by rank.

    python examples/big_model.py --write-weights /tmp/gpt.safetensors --preset 20m   # weights to start from
    zerobridge run --nproc 2 --stage 3 examples/big_model.py --weights /tmp/gpt.safetensors --preset 20m
    zerobridge run --nproc 2 --stage 3 examples/big_model.py --preset 20m            # from scratch (replayed init)

No rank ever holds the whole model: ``prepare`` replays each module's init
into its own shard, one module at a time, and ``load_pretrained`` reads only
the byte ranges of the file that each rank keeps. ``--weights`` also takes a
Hugging Face model directory or a ``zerobridge.save_checkpoint`` directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.distributed as dist

import zerobridge
from zerobridge.errors import ConfigError
from zerobridge.models import SyntheticTokens, shard, tiny_gpt


def write_weights(path: str, preset: str) -> None:
    """Pretrained weights to load: the preset's model from seed 1, tied head saved once."""
    from safetensors.torch import save_file

    state = tiny_gpt(preset, seed=1).state_dict()
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="tiny, 20m or 100m")
    parser.add_argument("--weights", default=None, help="safetensors file or directory to start from")
    parser.add_argument("--write-weights", default=None, metavar="FILE", help="write starting weights and exit")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--log-file", default=None, help="write one JSON line per step here (rank 0)")
    args = parser.parse_args()
    if args.write_weights:
        write_weights(args.write_weights, args.preset)
        return
    try:
        model = zerobridge.prepare(tiny_gpt(args.preset, device="meta"))  # the strategy: ZEROBRIDGE_CONFIG
        if args.weights:
            report = zerobridge.load_pretrained(model, args.weights)
    except ConfigError as exc:
        sys.exit(f"big_model.py: {exc}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.weights and rank == 0:
        print(f"loaded {report.loaded} tensors; rank 0 read {report.bytes_read / 2**20:.1f} MiB")
    data = SyntheticTokens(model.config.vocab_size, args.seq_len, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with open(args.log_file, "w") if args.log_file and rank == 0 else contextlib.nullcontext() as log:
        for step in range(args.steps):
            x, y = (shard(t, rank, world) for t in data.batch(step, args.global_batch))
            loss = model(x, targets=y)
            loss.backward()
            zerobridge.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().reshape(1)
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step}  loss {mean.item() / world:.4f}")
                if log:
                    log.write(json.dumps({"step": step, "loss": mean.item() / world}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
