"""Train the built-in tiny GPT on synthetic tokens with zerobridge.

    python examples/train_gpt.py --steps 20                             # one process (world size 1)
    zerobridge run --nproc 2 --stage 3 examples/train_gpt.py            # two processes, ZeRO-3
    zerobridge run --nproc 4 --config ds_config.json examples/train_gpt.py
    zerobridge run --nproc 2 --strategy fsdp:SHARD_GRAD_OP examples/train_gpt.py
    zerobridge run --nproc 2 --stage 3 --backend fsdp examples/train_gpt.py        # torch FSDP2
    zerobridge run --nproc 2 --stage 3 --backend deepspeed examples/train_gpt.py   # DeepSpeed ZeRO
    torchrun --nproc-per-node 2 examples/train_gpt.py --stage 2         # plain torchrun works too

The script names no strategy and no backend: ``zerobridge run`` passes them
in ZEROBRIDGE_CONFIG and ZEROBRIDGE_BACKEND, so switching between ZeRO
stages, FSDP strategies and engines changes no line here. It uses only what
every backend answers: the optimizer is built before ``prepare`` and passed
to it (DeepSpeed takes it when it builds its engine), ``prepare`` returns
the model and the optimizer to step, and the spec is read back with
``zerobridge.spec_of``. Global batch 8 of 16 tokens, split across ranks.
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
from zerobridge.models import SyntheticTokens, no_weight_decay, shard, tiny_gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--preset", default="tiny", help="tiny, 20m or 100m")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--stage", type=int, default=None, help="override ZEROBRIDGE_CONFIG with a ZeRO stage")
    parser.add_argument("--log-file", default=None, help="write one JSON line per step here (rank 0)")
    args = parser.parse_args()

    model = tiny_gpt(args.preset, seed=0)
    data = SyntheticTokens(model.config.vocab_size, args.seq_len, seed=0)
    # Param groups chosen by name, on the model as built; prepare keeps groups and hyperparameters.
    no_decay = [p for n, p in model.named_parameters() if no_weight_decay(n)]
    decay = [p for n, p in model.named_parameters() if not no_weight_decay(n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    try:  # stage=None: ZEROBRIDGE_CONFIG decides; the backend: ZEROBRIDGE_BACKEND, else native
        model, optimizer = zerobridge.prepare(model, optimizer, stage=args.stage)
    except ConfigError as exc:
        sys.exit(f"train_gpt.py: {exc}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        sys.exit(f"train_gpt.py: --global-batch {args.global_batch} does not split over {world} ranks")
    summary = zerobridge.spec_of(model).summary()
    if rank == 0:
        print(f"{world} rank(s): {summary}")
    with open(args.log_file, "w") if args.log_file and rank == 0 else contextlib.nullcontext() as log:
        for step in range(args.steps):
            zerobridge.reset_stats(model)
            x, y = (shard(t, rank, world) for t in data.batch(step, args.global_batch))
            loss = model(x, targets=y)
            loss.backward()
            norm = zerobridge.clip_grad_norm_(model, 1.0)
            optimizer.step()
            stats = zerobridge.stats(model)
            optimizer.zero_grad()
            mean = loss.detach().reshape(1)
            dist.all_reduce(mean)
            record = {"step": step, "loss": mean.item() / world, "grad_norm": norm.item(),
                      "model_state_bytes": stats["param_bytes"] + stats["grad_bytes"] + stats["optimizer_bytes"],
                      "comm_bytes": sum(stats["comm_bytes"].values()), "strategy": summary}
            if rank == 0:
                print(f"step {step:3d}  loss {record['loss']:.4f}  grad norm {record['grad_norm']:.3f}  "
                      f"model state {record['model_state_bytes'] / 2**20:.2f} MiB/rank  "
                      f"comm {record['comm_bytes'] / 2**20:.2f} MiB/step")
                if log:
                    log.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
