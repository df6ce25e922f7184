"""examples/train_gpt.py launched by `zerobridge run` trains like one process, on every backend.

The script names no strategy and no backend; `zerobridge run --stage/--strategy
--backend` chooses them through ZEROBRIDGE_CONFIG and ZEROBRIDGE_BACKEND. Judged
by the JSON lines rank 0 writes, not by the launcher's exit code alone (gloo can
abort at interpreter exit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerobridge.testing.gpt import reference_gpt

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the launched ranks
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))


def launch(tmp_path: Path, *choice: str, steps: int = 3) -> list[dict[str, object]]:
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "zerobridge.cli", "run", "--nproc", "2", "--standalone", *choice,
           str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps), "--log-file", str(log)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert log.exists(), done.stdout + done.stderr
    assert "exited without calling zerobridge.prepare" not in done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("choice", [("--stage", "3"), ("--strategy", "fsdp:SHARD_GRAD_OP"),
                                    ("--stage", "3", "--backend", "fsdp"), ("--stage", "3", "--backend", "deepspeed")])
def test_example_under_zerobridge_run_matches_one_process(tmp_path: Path, choice: tuple[str, ...]) -> None:
    records = launch(tmp_path, *choice)
    reference = reference_gpt(steps=3)  # so the backends agree with one another as well
    assert [r["step"] for r in records] == [0, 1, 2]
    for record, loss, norm in zip(records, reference.losses, reference.grad_norms):
        assert abs(float(record["loss"]) - loss) <= 1e-5 * loss  # type: ignore[arg-type]
        assert abs(float(record["grad_norm"]) - norm) <= 1e-5 * norm  # type: ignore[arg-type]
    assert str(records[0]["strategy"]).startswith("stage 3")


def test_big_model_example_loads_weights_and_trains_like_one_process(tmp_path: Path) -> None:
    import torch

    from zerobridge.models import SyntheticTokens, tiny_gpt

    weights = tmp_path / "gpt.safetensors"
    script = str(ROOT / "examples" / "big_model.py")
    subprocess.run([sys.executable, script, "--write-weights", str(weights)], check=True, timeout=120)
    log = tmp_path / "log.jsonl"
    done = subprocess.run([sys.executable, "-m", "zerobridge.cli", "run", "--nproc", "2", "--standalone", "--stage",
                           "3", script, "--weights", str(weights), "--steps", "3", "--log-file", str(log)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert log.exists(), done.stdout + done.stderr
    assert "loaded" in done.stdout
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    model = tiny_gpt("tiny", seed=1)  # the weights the file holds, in one process
    data = SyntheticTokens(model.config.vocab_size, 16, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, got in enumerate(losses):
        x, y = data.batch(step, 8)
        loss = model(x, targets=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert abs(got - loss.item()) <= 1e-5 * loss.item(), (step, got, loss.item())
    assert len(losses) == 3
