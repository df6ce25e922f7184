"""The sections of docs/translators.md written around figures and tables the code holds: DeepSpeed's buckets
for a source that leaves them to the engine (with ``bench/deepspeed_buckets.py``'s measurement), running under
Trainer (the run-level keys, the flags, the report's levels) and a launch script converted. ``zerobridge.docgen``
puts them after the mapping tables.

    >>> from zerobridge.docgen_sections import under_trainer
    >>> under_trainer()[0]
    '\\n## Running under Trainer\\n\\n'
"""

from __future__ import annotations

import ast
import enum
import inspect
import json
from pathlib import Path

from zerobridge.translate import trainer_args
from zerobridge.translate.report import IMPACTS, Impact
from zerobridge.translate.run_level import CLI_FLAGS, RUN_LEVEL_KEYS, TRAINER_FLAGS

__all__ = ["bucket_sizing", "launch_script_example", "under_trainer"]

REPO = Path(__file__).resolve().parent.parent


def bucket_sizing() -> list[str]:
    """The "DeepSpeed's buckets" section: what ``--to deepspeed`` writes for ``per_unit``, and the measured figure."""
    out = ["\n## DeepSpeed's buckets for a source that leaves them to the engine\n\n",
           "FSDP1 and FSDP2 kwargs, Accelerate FSDP, Lightning's FSDP strategies, torchtitan and the FSDP registry "
           "names gather and reduce one wrap unit at a time (spec `\"per_unit\"`). DeepSpeed has no per-unit form: "
           "it sizes its buffers in elements, and preallocates them. Its defaults (5e8 elements for the reduce "
           "bucket, 5e7 for prefetch) are sized for billion-parameter layers, and cost the same on any model: 3.7 GiB "
           "per rank at stage 2 in fp32 (two 5e8-element reduce buffers with `overlap_comm`), 1.9 GiB at stage 3 "
           "(one flat bucket). "
           "`--to deepspeed` therefore never writes them for `per_unit`:\n\n"
           "| DeepSpeed key | model known | model not known | source states a number |\n|---|---|---|---|\n"
           "| `reduce_bucket_size` | hidden_size^2, what Trainer and Accelerate fill `\"auto\"` with (at most the "
           "largest unit; a model without a hidden size: the largest wrap unit's parameter count) | `\"auto\"`: "
           "Trainer and Accelerate fill hidden_size^2 | kept |\n"
           "| `stage3_prefetch_bucket_size` | the largest wrap unit's parameter count | stage 3: `\"auto\"` (0.9 x "
           "hidden_size^2); below: DeepSpeed's default, unused | kept |\n"
           "| `allgather_bucket_size` | the largest wrap unit's parameter count | DeepSpeed's default: it allocates "
           "nothing for it | kept |\n"
           "| `stage3_max_live_parameters` | the largest wrap unit's parameter count (FSDP frees a unit after use "
           "and prefetches one; unbounded, DeepSpeed prefetches as far as its prefetch bucket reaches) | no bound "
           "(Trainer does not fill it) | kept |\n"
           "| `stage3_param_persistence_threshold` | the spec's: 0 from FSDP sources (every parameter sharded, as "
           "FSDP does) | the same | kept |\n\n"
           "The model is known to `zerobridge convert --to deepspeed --model config.json` (a Hugging Face config "
           "or model directory built on the meta device, or a name `zerobridge plan` takes; one it cannot build "
           "exits 2 naming the file), to `zerobridge plan --to deepspeed` (the planner's own candidates are sized "
           "too: their 5e8 is the spec's default, not a choice; `--config` files keep theirs), and to "
           "`prepare(backend=\"deepspeed\")` and `zerobridge.deepspeed.initialize`. One function sizes them "
           "everywhere (`zerobridge.runtime.wrap_units.bucket_sizes`): with the all-gather and prefetch buckets of "
           "the largest unit, a bucket holds what one of the source's collectives holds (counts are rounded up to "
           "even: DeepSpeed asserts it of `allgather_bucket_size`). The reduce bucket is different: DeepSpeed "
           "preallocates it and holds it through every backward (twice at stages 1-2 with `overlap_comm`, from "
           "setup on at stage 3), where FSDP holds a unit's gradients only while it reduces them. Sized to the "
           "largest unit it was the largest term of DeepSpeed's backward: the tiny Llama at ZeRO-2 in fp32 "
           "(world 2) peaked at 129.5 MiB with a 5.0M-element bucket (the whole model, its one unit), 101.1 MiB "
           "at hidden_size^2 (65,536), against the native engine's 85.8 MiB (docs/plan.md). So it is written at "
           "hidden_size^2, as Trainer fills `\"auto\"`: a JSON written with `--model` and one written as "
           "`\"auto\"` and filled by Trainer are the same run. DeepSpeed reduces a gradient larger than the "
           "bucket from its own tensor, without copying it into the bucket, so the bucket's size changes how many "
           "collectives run, not which gradients are summed. Plain `deepspeed.initialize` "
           "drops `\"auto\"` without a word and preallocates its default: pass `--model`.\n\n"
           "A bucket the source states is kept, with one exception where the model is known: a "
           "`reduce_bucket_size` larger than the whole model (DeepSpeed's 5e8 default, which a DeepSpeed source "
           "and the registry's stage specs carry, on any model under 500M parameters) is written at the model's "
           "parameter count. Every gradient fits one bucket at either size, so the reductions are the same; "
           "DeepSpeed preallocates what is written, and on a 2 MB model `prepare(model, stage=2, "
           "backend=\"deepspeed\")` held 4.00 GB per rank before and 2.89 MB after (docs/compare.md). The report "
           "files it as equivalent, under memory, with both costs.\n\n"
           "The report files these keys, `max_live_parameters` and the persistence thresholds under memory, with "
           "the bytes (`translate/deepspeed_buckets.py`; the DeepSpeed writer's all-gather entry is speed: DeepSpeed "
           "allocates nothing for that bucket): at stages 1-2 DeepSpeed preallocates 2 x "
           "`reduce_bucket_size` elements with `overlap_comm` (1 x without), at stage 3 one flat reduce bucket of "
           "`reduce_bucket_size`, and at stage 3 it gathers up to `stage3_prefetch_bucket_size` elements ahead "
           "of use; all in the compute dtype.\n"]
    measured = REPO / "bench" / "results" / "deepspeed_buckets.json"
    if measured.is_file():
        result = json.loads(measured.read_text(encoding="utf-8"))
        out.append(f"\nMeasured with `python bench/deepspeed_buckets.py` ({result['source']}, {result['model']}, "
                   f"world {result['world_size']} on CPU, {result['micro_batch']} x {result['seq_len']} tokens per "
                   "rank, two AdamW steps; peak live tensor bytes of the training phases on the busier rank, counted "
                   "as `zerobridge plan` counts them):\n\n| run | buckets | peak | vs FSDP2 |\n|---|---|---|---|\n")
        names = {"fsdp2": "FSDP2 backend, the same spec", "old": "DeepSpeed, the JSON written before",
                 "new": "DeepSpeed, written with `--model`"}
        for name, peak in result["peak_bytes"].items():
            buckets = result["buckets"].get(name)
            shown = ", ".join(f"{v:.3g}" for v in buckets.values()) if buckets else "one unit per collective"
            out.append(f"| {names[name]} | {shown} | {peak / 2**20:.1f} MiB | "
                       f"{result['ratio_to_fsdp2'][name]:.2f}x |\n")
        out.append("\nBuckets are `reduce_bucket_size`, `allgather_bucket_size`, `stage3_prefetch_bucket_size`. "
                   "`tests/test_deepspeed_buckets.py` runs the JSON written with the model from every Accelerate "
                   "FSDP config of the corpus under real DeepSpeed and checks each against the FSDP2 backend's "
                   "peak on the same model. What the JSON decides (buckets, prefetch, the live-parameter bound, "
                   "the sub-group step), DeepSpeed's peak above the state it keeps between steps, is 0.93x to 0.95x "
                   "of FSDP2's in every group (asserted within 1.15x). The whole peak is 1.15x FSDP2's for four of "
                   "the eight config groups, 1.18x (Accelerate's `cp`), "
                   "1.23x (Accelerate's `latest_fsdp`) and 1.31x (LLaMA-Factory's `fsdp_config`, and its "
                   "`fsdp_config_offload` with TRL's `fsdp_qlora`); with the reduce bucket at the largest unit "
                   "they were 1.21x .. 1.38x, and the JSON above peaked at 69.6 MiB, 1.21x (it asserts 1.35x; "
                   "the JSON above also bounds live parameters "
                   "and steps in sub-groups at the same unit: `stage3_max_live_parameters`, `sub_group_size`). The "
                   "buckets are no longer what costs: DeepSpeed's own state is, and the test checks it against "
                   "the formula below (9.7 MiB beyond FSDP2's in bf16, 19.3 MiB in fp32; 19.2 MiB with the "
                   "optimizer and parameters offloaded, host memory on a GPU machine, counted here because a "
                   "CPU's host and device are one memory). Between steps it keeps a 16-bit "
                   "parameter partition and a gradient partition beside the fp32 master and the Adam moments "
                   "(16P/N bytes in bf16; 20P/N in fp32, where `stage3.py` compares a tensor's `torch.device` "
                   "with the accelerator's device name, a string, so the branch that lets fp32 parameters serve "
                   "as their own master never runs), where FSDP2 keeps 12P/N (its fp32 shard is the master, its "
                   "gradients are freed every step). On this 5M-parameter model at 2 x 128 tokens that is a "
                   "quarter of FSDP2's peak or more; it shrinks relative to it as activations grow. An earlier "
                   "version of this page gave 0.79x: the counter weighed each FSDP2 DTensor at its global size "
                   "(N times its shard), which put FSDP2's peaks too high; it now counts the shard a DTensor "
                   "wraps (`planning/tracker.py`).\n")
    return out


def under_trainer() -> list[str]:
    """The "Running under Trainer" section: run-level keys, optimizer/scheduler flags, the report's levels."""
    out = ["\n## Running under Trainer\n\n",
           "Most users launch Hugging Face `Trainer` (directly or through axolotl, TRL, LLaMA-Factory), which fills "
           "a DeepSpeed JSON's `\"auto\"` values from `TrainingArguments` and refuses concrete values that disagree "
           "with them. `tests/test_trainer_config.py` runs that check on every DeepSpeed JSON written from the corpus "
           "and the registry; `tests/test_trainer_deepspeed.py` runs Trainer at world 2 under `--deepspeed` with "
           "them and compares each step with plain DDP.\n\n",
           "### Which keys become `\"auto\"`\n\n",
           "A source that leaves a run-level value to the training script (Accelerate FSDP and DDP configs, FSDP "
           "kwargs without that `training_loop` key, Lightning and registry names; precision when the source does "
           "not state it) reads it as `\"auto\"`, and a DeepSpeed JSON written from it says `\"auto\"`. A source "
           "that states it (a DeepSpeed JSON, torchtitan, a `training_loop` key) keeps its value. Plain "
           "`deepspeed.initialize` cannot read `\"auto\"`: `zerobridge convert` states each value with a flag.\n\n"
           "| DeepSpeed key | spec field | Trainer fills it from | `zerobridge convert` flag |\n|---|---|---|---|\n"]
    for key, name in RUN_LEVEL_KEYS:
        spec_path = f"precision.{name}" if name == "param_dtype" else f"batch.{name}"
        out.append(f"| `{key}` | `{spec_path}` | `{TRAINER_FLAGS[name]}` | `{CLI_FLAGS[name]}` |\n")
    out.append("\nWith no batch key at all, `train_micro_batch_size_per_gpu: \"auto\"` is written: DeepSpeed needs "
               "one. "
               "`--world-size N` overrides a source written for another world size, with a warning.\n\n"
               "### Optimizer and scheduler\n\n"
               "An Accelerate YAML, FSDP kwargs and Lightning strategies cannot carry a DeepSpeed `optimizer` or "
               "`scheduler` section. The report says so once per section, as a change to the numbers, naming the "
               "`TrainingArguments` flags that rebuild it; `zerobridge convert SRC --trainer-args` prints them on "
               "one line (with the stated run-level values), `--trainer-code` prints torch code for a plain loop "
               "(exact, DeepSpeed's own schedule formula). The flags hold with and without the DeepSpeed JSON.\n\n"
               "```\n" + _docstring_table(trainer_args.__doc__ or "") + "```\n\n"
               "### What the report warns about\n\n"
               "Every entry not carried exactly says what it changes; stderr warns, one line each, about the first "
               "two, folds the third into one note line, and `--explain` lists everything. `--strict` exits 1 on any "
               "approximation, whatever it changes. `\"auto\"` values are not warned: both flavors fill them from "
               "the same arguments.\n\n| changes | meaning | spec paths |\n|---|---|---|\n")
    for impact in Impact:
        paths = ", ".join(f"`{p}`" for p, i in IMPACTS.items() if i is impact)
        doc = " ".join((_member_doc(Impact, impact.name) or "").split())
        out.append(f"| `{impact.value}` | {doc} | {paths} |\n")
    return out


_ALPACA = r"""cat > train.sh <<'EOF'
torchrun --nproc_per_node=8 --master_port=20001 train.py \
    --model_name_or_path $MODEL_PATH \
    --data_path ./alpaca_data.json \
    --bf16 True \
    --output_dir output \
    --num_train_epochs 3 \
    --per_device_train_batch_size 2 \
    --gradient_accumulation_steps 32 \
    --learning_rate 2e-5 \
    --weight_decay 0. \
    --warmup_ratio 0.03 \
    --lr_scheduler_type "cosine" \
    --fsdp "full_shard auto_wrap" \
    --fsdp_transformer_layer_cls_to_wrap 'LlamaDecoderLayer' \
    --gradient_checkpointing True
EOF
zerobridge convert train.sh --to trainer-fsdp -o fsdp.json
zerobridge convert train.sh --to trainer-deepspeed -o ds.json
zerobridge convert train.sh --to torchtitan --world-size 8 -o job.toml
"""
"""The worked example's commands: a bash block (its heredoc makes the script, so it runs as written)."""

_ALPACA_FLAGS = ("--fsdp --fsdp_config fsdp.json --per_device_train_batch_size 2 --gradient_accumulation_steps 32 "
                 "--max_grad_norm 1.0 --bf16 --model_name_or_path '$MODEL_PATH' --data_path ./alpaca_data.json "
                 "--output_dir output --num_train_epochs 3 --learning_rate 2e-5 --weight_decay 0. "
                 "--lr_scheduler_type cosine --warmup_steps 0.03")


def launch_script_example() -> list[str]:
    """A worked example: an Alpaca-style launch script to Trainer's current FSDP form, DeepSpeed and torchtitan."""
    return [
        "\n## A launch script, converted\n\n",
        "An Alpaca-style fine-tuning script (the form of FastChat's and many Llama and Qwen recipes) is read from its "
        "`torchrun` line. `--to trainer-fsdp` writes the same run in transformers 5's form, `--to trainer-deepspeed` "
        "as DeepSpeed ZeRO-3 under Trainer, `--to torchtitan` as a torchtitan job:\n\n",
        "```bash\n" + _ALPACA + "```\n\n",
        "The first command writes `fsdp.json` and prints, on one line, the flags that replace the script's (the "
        "script's own flags, `--model_name_or_path $MODEL_PATH` among them, come back unchanged; without `-o` the "
        "config goes inline as JSON):\n\n",
        "```text\n" + _ALPACA_FLAGS + "\n```\n\n",
        "`fsdp.json` holds `version` 2, `reshard_after_forward` true, `cpu_offload` false, `auto_wrap_policy` "
        "`TRANSFORMER_BASED_WRAP`, `transformer_layer_cls_to_wrap` `[\"LlamaDecoderLayer\"]`, "
        "`activation_checkpointing` true and `cpu_ram_efficient_loading` false. The deprecated forms are read as "
        "transformers 5 reads them and reported (`--explain`), not warned: `--fsdp \"full_shard auto_wrap\"` is "
        "FSDP2 with `reshard_after_forward` (transformers 4.x ran FSDP1 FULL_SHARD, the same sharding), "
        "`--fsdp_transformer_layer_cls_to_wrap` moves into `fsdp_config`, `--gradient_checkpointing` becomes "
        "FSDP's own `activation_checkpointing`, and `--warmup_ratio 0.03` becomes `--warmup_steps 0.03`.\n\n",
        "The trainer-fsdp conversion warns about nothing; `tests/test_translate_trainer.py` parses its output with "
        "`HfArgumentParser(TrainingArguments)` and compares `fsdp_plugin_args` with what was meant. The DeepSpeed "
        "JSON passes Trainer's own fill-and-check; its three warnings are the two buckets Trainer fills from the "
        "model's hidden size and ZeRO-3 gathering each submodule rather than each layer. The torchtitan job warns "
        "once: torchtitan reduces gradients in fp32, where Accelerate's bf16 policy reduces them in bf16. A "
        "script that names its DeepSpeed JSON in a variable (`--deepspeed $DS_CONFIG`) is read with the variable "
        "set as its caller sets it: `DS_CONFIG=ds.json zerobridge convert train.sh --to trainer-fsdp`.\n",
    ]


def _docstring_table(doc: str) -> str:
    """The ``====``-ruled table in a module docstring, as text."""
    lines = doc.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    return "\n".join(lines[rules[0]:rules[-1] + 1]) + "\n" if len(rules) >= 2 else ""


def _member_doc(enum_cls: type[enum.Enum], name: str) -> str | None:
    """The docstring written under an enum member (read from the source)."""
    tree = ast.parse(inspect.getsource(enum_cls))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            return str(after.value.value)
    return None
