"""Train a tiny Llama with Hugging Face ``Trainer``: the real client of a DeepSpeed JSON zerobridge writes.

    python -m torch.distributed.run --nproc-per-node 2 -m zerobridge.testing.trainer_run \\
        --output_dir /tmp/out --max_steps 4 --per_device_train_batch_size 2 \\
        --gradient_accumulation_steps 2 --deepspeed written.json --steps-out /tmp/steps.json

Several runs share one launch with ``--jobs jobs.json`` (a JSON list of argv
lists, each as the command line above would take it; ``run_jobs``).

``main`` parses ``TrainingArguments`` (every Trainer flag, ``--deepspeed``
included) plus ``--steps-out PATH``, where rank 0 writes the logged ``loss``
and ``grad_norm`` of every optimizer step, the lr it ran at, and what trained
(``engine_of``: DeepSpeed or not, ZeRO stage, optimizer class) as JSON. Everything else is fixed
so two runs differ only in their flags: the model is a 2-layer fp32 Llama
(hidden 32, 2 heads, vocab 128) built from ``LlamaConfig`` under seed
``MODEL_SEED`` *before* ``TrainingArguments`` exist (so ZeRO-3 does not
build it inside ``zero.Init``: DDP and DeepSpeed start from the same
weights); the data are fixed random token sequences (labels = input ids)
read in order (``--train_sampling_strategy sequential``). ``DEFAULTS`` come
before ``argv``, so the command line can override any of them.

``--deepspeed-schedule JSON`` (a run without ``--deepspeed``) steps the lr
with the scheduler that JSON's ``scheduler`` section names, built by
DeepSpeed's own class (``deepspeed_scheduler``): a DDP reference for a
DeepSpeed run whose schedule no Trainer flag reproduces step for step.

Trainer logs ``grad_norm`` from ``accelerator.clip_grad_norm_``: under DDP
the pre-clip norm of the all-reduced gradients, under DeepSpeed the engine's
``get_global_grad_norm()``, which the ZeRO optimizers (stages 1-3) record
and stage 0's plain torch optimizer does not (then ``grad_norm`` is null).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

__all__ = ["DEFAULTS", "MODEL_SEED", "RunArgs", "TokenBatches", "deepspeed_scheduler", "engine_of", "main",
           "run_jobs", "tiny_llama", "train"]

MODEL_SEED = 0
"""Seed of the model's initial weights, independent of ``--seed``."""

DEFAULTS: tuple[str, ...] = (
    "--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--seed", "0", "--logging_steps", "1",
    "--dataloader_drop_last", "true", "--train_sampling_strategy", "sequential", "--max_steps", "4",
    "--disable_tqdm", "true",
)
"""Flags every run gets before its own (which win)."""

VOCAB = 128
SEQ_LEN = 16


def tiny_llama() -> Any:
    """A 2-layer fp32 ``LlamaForCausalLM`` (hidden 32, 2 heads, vocab 128), the same weights every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2 * SEQ_LEN,
                         tie_word_embeddings=False)
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(config)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    return model


class TokenBatches(Dataset[dict[str, torch.Tensor]]):
    """``size`` fixed random token sequences (generator seed 0) with labels = input ids."""

    def __init__(self, size: int, seq_len: int = SEQ_LEN, vocab: int = VOCAB) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


@dataclass
class RunArgs:
    """The script's own flags, beside ``TrainingArguments``."""

    steps_out: str | None = field(default=None, metadata={
        "aliases": ["--steps-out"],
        "help": "rank 0 writes {engine: {...}, steps: [{step, loss, grad_norm, lr}, ...]} here as JSON"})
    deepspeed_schedule: str | None = field(default=None, metadata={
        "aliases": ["--deepspeed-schedule"],
        "help": "without --deepspeed only: step the lr with the scheduler this DeepSpeed JSON names, built by "
                "DeepSpeed's own class after Trainer fills its 'auto' values (as a --deepspeed run would)"})


def _step_logger(out: list[dict[str, Any]]) -> Any:
    from transformers import TrainerCallback

    class StepLogger(TrainerCallback):
        """Keeps every log with a training ``loss`` (one per optimizer step at ``--logging_steps 1``), with the
        lr the step ran at: the optimizer's before the step's first micro-batch. (The logged ``learning_rate``
        differs between the two: under DeepSpeed the engine has already stepped the scheduler when Trainer
        reads it, so it is the next step's.)"""

        def __init__(self) -> None:
            self.lr: float | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            self.lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if state.is_world_process_zero and logs and "loss" in logs:
                norm = logs.get("grad_norm")
                out.append({"step": state.global_step, "loss": float(logs["loss"]),
                            "grad_norm": None if norm is None else float(norm), "lr": self.lr})

    return StepLogger()


def deepspeed_scheduler(path: str, args: Any, model: Any, optimizer: Any, num_training_steps: int) -> Any:
    """The lr scheduler a ``--deepspeed path`` run gets from its ``scheduler`` section: filled by
    ``HfTrainerDeepSpeedConfig`` from ``args`` and built by the ``deepspeed.runtime.lr_schedules`` class
    (or ``torch.optim.lr_scheduler`` one) of that name, on ``optimizer``, as the DeepSpeed engine builds it."""
    import torch.optim.lr_scheduler as torch_schedules
    from deepspeed.runtime import lr_schedules
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    hf = HfTrainerDeepSpeedConfig(path)
    try:
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model, num_training_steps)
    finally:
        unset_hf_deepspeed_config()  # this run is not DeepSpeed: no ZeRO-3 weakref
    section = hf.config["scheduler"]
    kind = getattr(lr_schedules, section["type"], None) or getattr(torch_schedules, section["type"])
    return kind(optimizer, **section.get("params", {}))


def _trainer_class(schedule: str | None) -> Any:
    from transformers import Trainer

    if schedule is None:
        return Trainer
    path: str = schedule

    class DeepSpeedScheduleTrainer(Trainer):
        """Trainer with the lr schedule of a DeepSpeed JSON's ``scheduler`` section, stepped once per optimizer
        step as Trainer steps its own (and as DeepSpeed's engine steps it)."""

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                self.lr_scheduler = deepspeed_scheduler(path, self.args, self.model,
                                                        optimizer or self.optimizer, num_training_steps)
                self._created_lr_scheduler = True
            return self.lr_scheduler

    return DeepSpeedScheduleTrainer


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Train with ``DEFAULTS + argv``; returns (and, on rank 0 with ``--steps-out``, writes) the step logs.
    ``--jobs FILE`` instead runs every job that file lists, one after another (``run_jobs``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--jobs"] and len(argv) == 2:
        run_jobs(Path(argv[1]))
        return []
    steps = train(argv)
    _leave()
    return steps


def run_jobs(path: Path) -> None:
    """Every job of ``path`` (a JSON list of argv lists) in this one process group, in order.

    One launch then pays the interpreter, torch, transformers and DeepSpeed imports and the group's
    rendezvous once for all its runs. Between jobs the process-wide state a Trainer leaves behind is
    cleared (Accelerate's shared state, transformers' ZeRO-3 config reference), so each job starts as a
    fresh launch would: the environment as the launch set it (Accelerate leaves ``ACCELERATE_USE_DEEPSPEED``
    set after a DeepSpeed run), its model rebuilt from ``MODEL_SEED``, ``--seed`` applied again. A job
    that raises writes ``{"error": traceback}`` to its ``--steps-out`` and the next job runs."""
    import traceback

    jobs: list[list[str]] = json.loads(path.read_text(encoding="utf-8"))
    launched = dict(os.environ)
    for argv in jobs:
        try:
            train(argv)
        except Exception:
            out = _steps_out(argv)
            if out is not None and (not dist.is_initialized() or dist.get_rank() == 0):
                Path(out).write_text(json.dumps({"error": traceback.format_exc()}), encoding="utf-8")
        os.environ.clear()
        os.environ.update(launched)
        _reset_between_jobs()
    _leave()


def _steps_out(argv: list[str]) -> str | None:
    for flag in ("--steps-out", "--steps_out"):
        if flag in argv and argv.index(flag) + 1 < len(argv):
            return argv[argv.index(flag) + 1]
    return None


def _reset_between_jobs() -> None:
    """Forget what the last Trainer set process-wide, keeping the process group."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _leave() -> None:
    if dist.is_available() and dist.is_initialized():
        # Leave together: a rank that exits while its peer still tears down gloo can abort the peer.
        dist.barrier()
        dist.destroy_process_group()


def train(argv: list[str]) -> list[dict[str, Any]]:
    """One Trainer run of ``DEFAULTS + argv``; rank 0 writes the step logs to ``--steps-out`` when given."""
    from transformers import HfArgumentParser, TrainingArguments

    model = tiny_llama()  # before TrainingArguments: see the module docstring
    parser = HfArgumentParser(cast(Any, (TrainingArguments, RunArgs)))
    args, run = parser.parse_args_into_dataclasses(args=[*DEFAULTS, *argv])
    if run.deepspeed_schedule and args.deepspeed:
        parser.error("--deepspeed-schedule is for a run without --deepspeed (DeepSpeed builds its own scheduler)")
    samples = max(args.max_steps, 1) * args.per_device_train_batch_size * args.gradient_accumulation_steps
    dataset = TokenBatches(samples * max(args.world_size, 1))
    steps: list[dict[str, Any]] = []
    trainer = _trainer_class(run.deepspeed_schedule)(model=model, args=args, train_dataset=dataset,
                                                     callbacks=[_step_logger(steps)])
    trainer.train()
    if run.steps_out and trainer.is_world_process_zero():
        record = {"engine": engine_of(trainer), "steps": steps}
        Path(run.steps_out).write_text(json.dumps(record, indent=1), encoding="utf-8")
    return steps


def engine_of(trainer: Any) -> dict[str, Any]:
    """What actually trained: DeepSpeed or not, its ZeRO stage, the optimizer class that stepped (DeepSpeed's
    basic optimizer inside its ZeRO wrapper; Trainer's inside Accelerate's), and the world size."""
    engine = trainer.deepspeed
    if engine is not None:
        optimizer = engine.basic_optimizer
        return {"deepspeed": True, "zero_stage": int(engine.zero_optimization_stage()),
                "optimizer": type(optimizer).__name__, "world_size": int(engine.world_size)}
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {"deepspeed": False, "zero_stage": None, "optimizer": type(optimizer).__name__,
            "world_size": int(trainer.args.world_size)}


if __name__ == "__main__":
    main()
