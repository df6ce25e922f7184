"""Every example a reader copies from README.md and docs/*.md runs, on the built-in models.

Each fenced ``python``, ``bash`` or ``console`` block is one test. The inputs
the docs name (``ds_config.json``, ``accelerate_fsdp.yaml``, ``MyModel``,
``model``, ``loader``, ...) are the files and names below, bound to the tiny
GPT; every page gets one temporary folder with them in it, shared by its
blocks in page order (a later block may read what an earlier one wrote).

- A python block runs in a fresh namespace, all of a page's python blocks in
  one subprocess: a plain script with no ``if __name__ == "__main__":`` guard,
  as a reader would paste them. ``PRELUDE`` binds the placeholders first.
- A bash/console block runs command by command: ``zerobridge ...`` in this
  process through ``zerobridge.cli.main``, anything else (``python ...``, a
  heredoc) with bash, ``.venv/bin`` first on PATH. A command is expected to
  exit 0 unless the line after it says ``# exit N``.
- What would take minutes runs smaller, and says so here: ``SHRINK`` lists
  each replaced argument per page.
- A block a CPU cannot run (GPUs, several nodes, the whole suite) says so in
  its first line, visible to the reader: ``# not run in CI: <reason>``. Such a
  block is a skipped test with that reason (``pytest -ra`` lists them); its
  ``zerobridge`` commands are still parsed by the CLI (flags, choices).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash", "console"}
NOT_RUN = re.compile(r"^\s*#\s*not run in CI:\s*(?P<reason>.+)$")
EXIT = re.compile(r"^\s*#\s*exit (?P<code>\d+)\b")
SYNOPSIS = re.compile(r" ?\[[^\]]*\](\.\.\.)?")  # a synopsis's optional ``[--flag VALUE]`` groups
COMMAND = re.compile(r"^([A-Z_]+=\S+|zerobridge|\.venv/bin/\S+|python|make|pip|torchrun|accelerate|deepspeed)\s")

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by every process a block starts
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

SHRINK: dict[str, list[tuple[str, str]]] = {
    # page: (as written, as run) -- the same command, fewer steps, stages, backends or processes
    # README: the loop runs with the block's own alternative config="ds_config.json", which accumulates
    "README.md": [("model = zerobridge.prepare(model, stage=3)   # or",
                   "model = zerobridge.prepare(model, config=\"ds_config.json\")   # or"),
                  ("--stages 2 3 --backends native fsdp deepspeed --steps 20",
                   "--stages 3 --backends native deepspeed --steps 2"),
                  ("examples/train_gpt.py  ", "examples/train_gpt.py --steps 2  "),
                  ("examples/train_gpt.py\n", "examples/train_gpt.py --steps 2\n"),
                  ("--nproc 4 --strategy fsdp:HYBRID_SHARD", "--nproc 2 --strategy fsdp:HYBRID_SHARD"),
                  ("llama-3-70b --world-size 64 --nodes 8 --device-memory 80GiB --seq-len 4096",
                   "tiny-gpt --world-size 64 --nodes 8 --device-memory 80GiB --seq-len 16")],
    "docs/checkpoints.md": [("\n...\n", "\nmodel(loader[0]).backward(); optimizer.step(); optimizer.zero_grad()\n"),
                            # the `...` is training: one step, so the optimizer has state to save and export
                            ("import-deepspeed ds_ckpt/ ckpt/imported", "import-deepspeed runs/ds ckpt/imported")],
                            # the DeepSpeed checkpoint the page's export example wrote
    "docs/compare.md": [("compare                      #", "compare --stages 3 --backends native --steps 2  #"),
                        ("--stages 3 --backends native fsdp --steps 50", "--stages 3 --backends fsdp --steps 2"),
                        ("accelerate_fsdp.yaml --markdown",
                         "accelerate_fsdp.yaml --backends native --steps 2 --markdown"),
                        ("--nproc 4 --tolerance 1e-4",
                         "--nproc 2 --stages 3 --backends native --steps 2 --tolerance 1e-4"),
                        ("dropped_reduction_20m \\\n    --config bf16z3.json --backends fsdp native --steps 6",
                         "dropped_reduction \\\n    --config bf16z3.json --backends fsdp native --steps 4"),
                        # its tiny-GPT form, which still breaks at step 3
                        ("stages=[2, 3], backends=[\"native\", \"deepspeed\"], nproc=2, steps=10",
                         "stages=[3], backends=[\"native\"], nproc=2, steps=2"),
                        ("--model tiny-gpt:20m --global-batch 4 --seq-len 128 \\\n    --config bf16z0.json bf16z1.json "
                         "bf16z2.json bf16z3.json --backends native fsdp deepspeed --steps 8",
                         "--model tiny-gpt --global-batch 4 --seq-len 16 \\\n    --config bf16z0.json bf16z3.json "
                         "--backends native --steps 2"),
                        ("--config acc2z0.json acc2z1.json acc2z2.json acc2z3.json --steps 3",
                         "--config acc2z0.json acc2z3.json --backends native --steps 2")],
    "docs/offload.md": [("/local_nvme", "local_nvme")],   # a folder the test makes
    "docs/plan.md": [("llama-3-70b --world-size 64 --nodes 8 --device-memory 80GiB --micro-batch 1 --seq-len 4096",
                      "tiny-gpt --world-size 64 --nodes 8 --device-memory 80GiB --micro-batch 1 --seq-len 16"),
                     ("tiny-gpt:20m --world-size 2 --device-memory 1GiB --seq-len 128",
                      "tiny-gpt --world-size 2 --device-memory 1GiB --seq-len 16"),
                     ("\"llama-3-8b\", world_size=16, nodes=2", "\"tiny-gpt\", world_size=16, nodes=2"),
                     ("seq_len=4096", "seq_len=16")],
}

SETUP = {  # run in the page's folder before its first block: what its commands read and no block of it writes
    "docs/cli.md": "model = zerobridge.prepare(MyModel(), stage=3)\n"
                   "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)\n"
                   "model(loader[0]).backward(); optimizer.step()\n"
                   "zerobridge.save_checkpoint('ckpt/step-100', model, optimizer, metadata={'step': 100})\n",
}

PRELUDE = '''
import torch, zerobridge
from zerobridge.models import SyntheticTokens, tiny_gpt

class MyModel(torch.nn.Module):
    """The docs' placeholder model: the tiny GPT; model(batch), model(x, y) or model(tokens, targets)."""
    def __init__(self, seed=0):
        super().__init__()
        self.gpt = tiny_gpt("tiny", seed=seed)
    def forward(self, x, y=None):
        if y is None:
            x, y = x
        return self.gpt(x, targets=y)

_data = SyntheticTokens(tiny_gpt("tiny").config.vocab_size, 16, seed=0)
loader = data = chunks = [_data.batch(step, 8) for step in range(4)]
model = MyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
device = "cpu"
total = 102
def warmup(step): return min(1.0, (step + 1) / 10)
'''

RUNNER = '''
import json, os, sys, traceback
import torch.distributed as dist
blocks, prelude, out = json.load(open(sys.argv[1])), open(sys.argv[2]).read(), sys.argv[3]
results = {}
for block in blocks:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(prelude, "<prelude>", "exec"), namespace)
        exec(compile(block["code"], block["where"], "exec"), namespace)
        results[block["where"]] = None
    except BaseException:
        results[block["where"]] = traceback.format_exc()
    if dist.is_initialized():
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)
'''

FILES = {
    "ds_config.json": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                       "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}},
    "ds.json": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 2}},
    "ds_zero2.json": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}},
    "a.json": {"zero_optimization": {"stage": 3}},
    "ds_zeropp.json": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}},
    "b.yaml": "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
              "  fsdp_sharding_strategy: FULL_SHARD\n",
    "accelerate_fsdp.yaml": "distributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\nfsdp_config:\n"
                            "  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n",
    "my_fsdp.yaml": "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n",
    "model-dir/config.json": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 4096,
                              "vocab_size": 256},
    "my-model/config.json": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 4096,
                             "vocab_size": 256},
    "train.py": "import sys\nprint('train.py', sys.argv[1:])\n",   # a launcher's target: it only says it ran
    "mypkg/__init__.py": "",
    "mypkg/bench.py": "from zerobridge.compare.workload import tiny_gpt_workload\n\n"
                      "def workload(seed):\n    return tiny_gpt_workload(seed)\n",
    "local_nvme/.keep": "",
    "mypkg/train.py": "import sys\nprint('mypkg.train', sys.argv[1:])\n",
    # as docs/compare.md defines them
    **{f"bf16z{s}.json": {"zero_optimization": {"stage": s}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}
       for s in range(4)},
    **{f"acc2z{s}.json": {"zero_optimization": {"stage": s}, "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": 2, "gradient_clipping": 1.0} for s in range(4)},
}


@dataclass(frozen=True)
class Block:
    page: str
    """Relative to the repository: ``README.md``, ``docs/cli.md``."""
    line: int
    """Of the opening fence."""
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def not_run(self) -> str | None:
        first = self.text.splitlines()[0] if self.text else ""
        found = NOT_RUN.match(first)
        return found["reason"].strip() if found else None

    def shrunk(self) -> str:
        text = self.text if self.text.endswith("\n") else self.text + "\n"
        for old, new in SHRINK.get(self.page, []):
            text = text.replace(old, new)
        return text


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a page, whatever its language."""
    found, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    page = str(path.relative_to(REPO))
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        found.append(Block(page, i + 1, opening[1], "\n".join(lines[i + 1:end])))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in ALL if b.lang in RUNNABLE]


def test_every_command_block_is_marked_runnable() -> None:
    """A block of commands tagged as prose would escape this test: tag it ``bash`` (or ``text`` for output)."""
    untagged = [b.where for b in ALL if b.lang not in RUNNABLE and b.lang != "yaml"
                and any(COMMAND.match(line) for line in b.text.splitlines())]
    assert not untagged, f"command blocks not tagged bash/python (so not run): {untagged}"


def test_most_blocks_run() -> None:
    """The marker is for what a CPU cannot do, not for what is inconvenient."""
    marked = [b for b in RUN if b.not_run]
    assert len(RUN) >= 40 and len(marked) * 2 < len(RUN), (len(RUN), [b.where for b in marked])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per page, made on first use: the input files and ``examples/`` beside them."""
    return {}


def _folder(folders: dict[str, Path], factory: pytest.TempPathFactory, page: str) -> Path:
    if page not in folders:
        here = factory.mktemp(page.replace("/", "_").replace(".md", ""))
        for name, content in FILES.items():
            target = here / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
        (here / "examples").symlink_to(REPO / "examples")
        folders[page] = here
        if page in SETUP:
            (here / "_setup.py").write_text(PRELUDE + SETUP[page], encoding="utf-8")
            subprocess.run([sys.executable, "_setup.py"], cwd=here, check=True, capture_output=True, timeout=120)
    return folders[page]


_PYTHON: dict[str, dict[str, str | None]] = {}


def _run_python(page: str, here: Path) -> dict[str, str | None]:
    """All runnable python blocks of ``page`` in one fresh interpreter (a plain script, no guard)."""
    if page not in _PYTHON:
        todo = [{"where": b.where, "code": b.shrunk()} for b in RUN
                if b.page == page and b.lang == "python" and not b.not_run]
        (here / "_blocks.json").write_text(json.dumps(todo), encoding="utf-8")
        (here / "_prelude.py").write_text(PRELUDE, encoding="utf-8")
        (here / "_runner.py").write_text(RUNNER, encoding="utf-8")
        done = subprocess.run([sys.executable, "_runner.py", "_blocks.json", "_prelude.py", "_results.json"],
                              cwd=here, capture_output=True, text=True, timeout=240)
        results_file = here / "_results.json"
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
        for block in todo:  # a crash that killed the interpreter: every block not reported failed with it
            results.setdefault(block["where"], f"the interpreter died (exit {done.returncode}):\n"
                                               f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        _PYTHON[page] = results
    return _PYTHON[page]


def commands(text: str) -> list[tuple[str, int]]:
    """The block's commands (continuation lines joined) and the exit code each is expected to give."""
    out: list[tuple[str, int]] = []
    pending = ""
    for line in text.splitlines():
        expected = EXIT.match(line)
        if expected and out and not pending:
            out[-1] = (out[-1][0], int(expected["code"]))
            continue
        command, _, comment = line.partition("  #")
        stripped = command.rstrip() if not line.lstrip().startswith("#") else ""
        said = EXIT.match("#" + comment)
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        if pending or stripped:
            out.append((pending + stripped, int(said["code"]) if said else 0))
        pending = ""
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _in_process(argv: list[str], here: Path) -> tuple[int, str]:
    from zerobridge.cli import main

    out = io.StringIO()
    before = Path.cwd()
    os.chdir(here)
    sys.path.insert(0, str(here))  # the page's own packages (mypkg) importable, as if installed
    if argv[0] == "run":  # each launch on a free port: torchrun's default 29500 may be another job's
        os.environ["PET_MASTER_PORT"] = str(_free_port())
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(before)
        sys.path.remove(str(here))
        os.environ.pop("PET_MASTER_PORT", None)
    return code, out.getvalue()


def _with_bash(script: str, here: Path) -> tuple[int, str]:
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = script.replace(".venv/bin/", "")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=here, env=env, capture_output=True,
                          text=True, timeout=240)
    return done.returncode, done.stdout[-3000:] + done.stderr[-5000:]


def _parse_only(block: Block) -> None:
    """A block that is not run still names real subcommands and flags."""
    from zerobridge.cli import _parser

    for command, _ in commands(block.text):
        argv = shlex.split(SYNOPSIS.sub("", command))
        if argv[0] in ("zerobridge", ".venv/bin/zerobridge"):
            try:
                _parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{block.where}: `{command}` does not parse")


def _run_commands(block: Block, here: Path) -> None:
    text = block.shrunk()
    if "<<" in text:  # a heredoc: the block is one script
        code, output = _with_bash(text, here)
        assert code == 0, f"{block.where} exited {code}:\n{text}\n{output}"
        return
    for command, expected in commands(text):
        argv = shlex.split(SYNOPSIS.sub("", command))
        if argv[0] in ("zerobridge", ".venv/bin/zerobridge"):
            code, output = _in_process(argv[1:], here)
        else:
            code, output = _with_bash(command, here)
        assert code == expected, f"{block.where}: `{command}` exited {code}, the docs say {expected}:\n{output[-6000:]}"


@pytest.mark.parametrize("block", RUN, ids=[f"{b.where}-{b.lang}" for b in RUN])
def test_doc_block_runs(block: Block, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    if block.not_run:
        _parse_only(block)
        pytest.skip(f"{block.where}: {block.not_run}")
    here = _folder(folders, tmp_path_factory, block.page)
    if block.lang == "python":
        error = _run_python(block.page, here)[block.where]
        assert error is None, f"{block.where}:\n{block.shrunk()}\n{error}"
    else:
        _run_commands(block, here)


OK_LINE = re.compile(r"OK: \d+ run\(s\) agree with [\w/']+ over \d+ steps: max loss deviation \d\.\d\de[-+]\d\d"
                     r"(, \.\.\.|, max grad-norm deviation \d\.\d\de[-+]\d\d( \((fp32|bf16|fp16): .*)?)?$")


def test_documented_verdicts_have_the_format_compare_prints() -> None:
    """The OK lines the docs quote (numbers from their own runs) read as `Comparison.verdict` writes them."""
    from zerobridge.compare import Comparison, Planned, RunOutcome
    from zerobridge.spec.presets import spec_for_stage

    def run(name: str) -> RunOutcome:
        planned = Planned(name, "native", name, 3, spec_for_stage(3), True)
        return RunOutcome(planned=planned, world_size=2, losses=[3.0, 2.0], grad_norms=[1.0, 1.0])

    printed = Comparison(runs=[run("native/stage0"), run("fsdp/stage3")], skipped=[], tolerance=1e-5,
                         norm_tolerance=1e-4, model="tiny-gpt", params=1, world_size=2, steps=2).verdict()
    assert OK_LINE.match(printed), printed
    quoted = [(page, line.split("# exit 0: ")[-1]) for page in PAGES
              for line in page.read_text(encoding="utf-8").splitlines() if re.match(r"^(# exit 0: )?OK: ", line)]
    assert quoted and all(OK_LINE.match(text) for _, text in quoted), \
        [f"{page.name}: {text}" for page, text in quoted if not OK_LINE.match(text)]


def test_inline_commands_and_paths_are_real() -> None:
    """Prose names real subcommands (`zerobridge convert`, not `translate`) and files that exist."""
    from zerobridge.cli import _COMMANDS

    where = [REPO, REPO / "zerobridge", REPO / "zerobridge" / "backends", REPO / "docs"]
    wrong = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        wrong += [f"{page.name}: zerobridge {sub}" for sub in re.findall(r"`zerobridge ([a-z][a-z-]*)", text)
                  if sub not in _COMMANDS]
        wrong += [f"{page.name}: {path}" for path in re.findall(r"`([\w.-]+/[\w./-]+\.(?:py|toml|md))`", text)
                  if not any((root / path).exists() for root in where)]
    assert not wrong, wrong
