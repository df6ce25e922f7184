"""Checkpoint files: box geometry, the portable writer and reader, safety (manifest,
atomic swap, restricted unpickling), safetensors, the CLI, and a save killed half way.

Everything here runs in one process except the kill tests, which need an
engine and a process to kill (a one-rank ``Cluster``).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from zerobridge.checkpoint.layout import Box, box_start, intersect, run_boxes
from zerobridge.checkpoint.portable import PortableState, read_portable, write_portable
from zerobridge.checkpoint.storage import CheckpointError, aside_dir, saving_dir, write_manifest
from zerobridge.cli import main

ME = "test_checkpoint"
# ---------------------------------------------------------------------------- geometry

@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_boxes_are_exactly_the_run_in_order(shape: list[int], data: st.DataObject) -> None:
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = run_boxes(tuple(shape), start, stop)
    index = torch.arange(numel).reshape(shape)
    cursor = start
    for box in boxes:
        assert box_start(tuple(shape), box) == cursor
        part = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        assert part.reshape(-1).tolist() == list(range(cursor, cursor + box.numel))  # contiguous in memory
        cursor += box.numel
    assert cursor == max(start, stop) if boxes else start == stop
    assert len(boxes) <= 2 * len(shape) - 1


def test_metadata_must_be_json() -> None:
    from zerobridge.checkpoint.metadata import metadata_json

    assert json.loads(metadata_json({"step": 3, "tags": ["a"]})) == {"step": 3, "tags": ["a"]}
    for bad in ({"when": object()}, {"loss": float("nan")}):
        with pytest.raises(CheckpointError, match="metadata: must be JSON"):
            metadata_json(bad)


def test_intersect() -> None:
    assert intersect(Box((0, 3), (1, 2)), Box((0, 0), (2, 4))) == Box((0, 3), (1, 1))
    assert intersect(Box((2, 0), (1, 4)), Box((0, 0), (2, 4))) is None
    assert intersect(Box((), ()), Box((), ())) == Box((), ())


# ---------------------------------------------------------------------------- portable

def portable_state() -> PortableState:
    tied = torch.randn(5, 3)
    return PortableState(
        model={"embed.weight": tied, "head.weight": tied, "norm.bias": torch.randn(3), "count": torch.tensor(7)},
        optimizer={"embed.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3)},
                   "norm.bias": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3)}},
        param_groups=[{"lr": 0.1, "betas": (0.9, 0.99), "params": ["embed.weight"]},
                      {"lr": 0.2, "betas": (0.9, 0.99), "params": ["norm.bias"]}],
        metadata={"step": 3, "source": "unit test"})


@pytest.fixture
def portable(tmp_path: Path) -> tuple[Path, PortableState]:
    state = portable_state()
    return write_portable(tmp_path / "ckpt", state), state


def test_portable_round_trip(portable: tuple[Path, PortableState]) -> None:
    path, state = portable
    back = read_portable(path)
    assert back.metadata == state.metadata and back.param_groups == state.param_groups
    assert set(back.model) == set(state.model)
    for name, value in state.model.items():
        assert torch.equal(back.model[name], value) and back.model[name].dtype == value.dtype
    assert {k: set(v) for k, v in back.optimizer.items()} == {k: set(v) for k, v in state.optimizer.items()}
    for fqn, entries in state.optimizer.items():
        for key, value in entries.items():
            assert torch.equal(back.optimizer[fqn][key], value)
    assert read_portable(path, optimizer=False).optimizer == {}


class _Sampler:
    """A plain object: ``torch.load(weights_only=True)`` refuses any class it does not know."""


def test_scheduler_and_client_state_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Any container ``weights_only`` reads back (tuple keys, ``None``, tensors); other objects refused before a
    byte is written; ``checkpoint info`` shows both."""
    state = portable_state()
    state.scheduler = {"last_epoch": 3, "base_lrs": [0.1, 0.2], "lr_lambdas": [None, None]}
    state.client_state = {"epoch": 2, "seen": torch.arange(3), "pairs": {(1, 2): ("x", None)}}
    back = read_portable(write_portable(tmp_path / "ckpt", state))
    assert back.scheduler == state.scheduler and back.metadata == state.metadata
    assert back.client_state is not None and torch.equal(back.client_state.pop("seen"), torch.arange(3))
    assert back.client_state == {"epoch": 2, "pairs": {(1, 2): ("x", None)}}
    code, out, _ = run_cli(capsys, "checkpoint", "info", str(tmp_path / "ckpt"))
    assert code == 0 and "scheduler    last_epoch 3, lr None" in out and "client_state keys epoch, pairs, seen" in out

    state.client_state = {"sampler": _Sampler()}
    with pytest.raises(CheckpointError, match=r"zerobridge.client_state: cannot be read back by torch.load\("
                                              r"weights_only=True\).*it holds a test_checkpoint._Sampler") as caught:
        write_portable(tmp_path / "refused", state)
    assert "fix: keep client_state to numbers" in str(caught.value)
    assert not list(tmp_path.glob("*refused*"))


def test_a_save_directory_whose_latest_names_a_checkpoint(portable: tuple[Path, PortableState]) -> None:
    """``zerobridge.deepspeed``'s engine saves ``DIR/<tag>`` and names the tag in ``DIR/latest``."""
    from zerobridge.checkpoint.reader import open_checkpoint

    path, _ = portable
    (path.parent / "latest").write_text(path.name)
    with pytest.raises(CheckpointError, match=f"names the checkpoint '{path.name}'[\\s\\S]*fix: load {path}"):
        open_checkpoint(path.parent)


def test_a_second_save_replaces_the_first_and_leaves_nothing_behind(portable: tuple[Path, PortableState],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path, state = portable
    state.metadata = {"step": 4}
    write_portable(path, state)  # renameat2(RENAME_EXCHANGE)
    assert read_portable(path).metadata == {"step": 4}
    from zerobridge.checkpoint import storage

    monkeypatch.setattr(storage, "_exchange", lambda a, b: False)  # systems without it
    state.metadata = {"step": 5}
    write_portable(path, state)
    assert read_portable(path).metadata == {"step": 5}
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]


def test_an_aside_copy_comes_back(portable: tuple[Path, PortableState]) -> None:
    path, state = portable
    os.rename(path, aside_dir(path))  # a kill between "old aside" and "new in"
    assert read_portable(path).metadata == state.metadata
    assert not aside_dir(path).exists()


# ---------------------------------------------------------------------------- safety

def flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-100]), "was truncated"),
    (lambda d: flip_byte(d / "__0_0.distcp"), "altered or corrupted"),
    (lambda d: flip_byte(d / ".metadata"), "altered or corrupted"),
    (lambda d: (d / "__0_0.distcp").unlink(), "is missing"),
    (lambda d: (d / "zerobridge.json").write_text("{\"format\": "), "is not valid JSON"),
], ids=["truncated", "flipped byte", "flipped metadata byte", "missing file", "broken manifest"])
def test_damage_is_found_before_anything_is_read(portable: tuple[Path, PortableState], damage: Any,
                                                 expected: str) -> None:
    path, _ = portable
    damage(path)
    with pytest.raises(CheckpointError) as info:
        read_portable(path)
    text = str(info.value)
    assert expected in text and str(path) in text and "fix:" in text


class _Payload:
    """Unpickling it runs a shell command (it would create ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_metadata_pickle_is_refused_without_running(portable: tuple[Path, PortableState],
                                                                tmp_path: Path) -> None:
    path, _ = portable
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    write_manifest(path, {})  # an attacker who rewrote the manifest too
    with pytest.raises(CheckpointError, match="refuses to unpickle posix.system"):
        read_portable(path)
    assert not marker.exists()
    pickle.loads((path / ".metadata").read_bytes())  # the payload is live: plain pickle runs it
    assert marker.exists()


def test_metadata_cannot_point_outside_the_checkpoint(portable: tuple[Path, PortableState]) -> None:
    from zerobridge.checkpoint.unpickle import read_metadata

    path, _ = portable
    with (path / ".metadata").open("rb") as fh:
        metadata = read_metadata(fh, "x")
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = "../elsewhere.distcp"
    with (path / ".metadata").open("wb") as fh:
        pickle.dump(metadata, fh)
    write_manifest(path, {})
    with pytest.raises(CheckpointError, match="not a file the manifest lists"):
        read_portable(path)


def test_byte_items_are_read_with_weights_only(portable: tuple[Path, PortableState]) -> None:
    import io

    from zerobridge.checkpoint.unpickle import decode_bytes

    buffer = io.BytesIO()
    torch.save(_Payload(Path("/nonexistent")), buffer)
    buffer.seek(0)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        decode_bytes(buffer, source="x", key="optim.param_groups.0.lr")


# ---------------------------------------------------------------------------- safetensors and the CLI

def test_consolidate_writes_every_name(portable: tuple[Path, PortableState], tmp_path: Path) -> None:
    from zerobridge.checkpoint.full import consolidate

    path, state = portable
    out = tmp_path / "model.safetensors"
    consolidate(path, out, dtype=torch.bfloat16)
    back = load_file(out)
    assert set(back) == set(state.model)
    assert back["embed.weight"].dtype == torch.bfloat16 and back["count"].dtype == torch.int64
    assert torch.equal(back["head.weight"], state.model["head.weight"].bfloat16())


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_info(portable: tuple[Path, PortableState], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = portable
    code, out, _ = run_cli(capsys, "checkpoint", "info", str(path))
    assert code == 0
    assert "every file matches zerobridge.json" in out and "4 tensors, 34 elements" in out
    assert "state for 2 parameter(s): exp_avg, step; step 3" in out and '"step": 3' in out
    code, out, _ = run_cli(capsys, "checkpoint", "info", str(path), "--json")
    info = json.loads(out)
    assert code == 0 and info["verified"] and info["optimizer_groups"] == 2 and info["metadata"]["step"] == 3


def test_cli_consolidate(portable: tuple[Path, PortableState], capsys: pytest.CaptureFixture[str],
                         tmp_path: Path) -> None:
    path, state = portable
    out_file = tmp_path / "out" / "model.safetensors"
    code, out, _ = run_cli(capsys, "checkpoint", "consolidate", str(path), "-o", str(out_file))
    assert code == 0 and "4 tensors" in out
    assert torch.equal(load_file(out_file)["norm.bias"], state.model["norm.bias"])
    assert sorted(p.name for p in out_file.parent.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("case", ["missing", "empty dir", "a file", "corrupted", "output is a directory"])
def test_cli_bad_input_exits_2_without_a_traceback(portable: tuple[Path, PortableState], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str], case: str) -> None:
    path, _ = portable
    target, extra, expected = str(path), [], ""
    if case == "missing":
        target, expected = str(tmp_path / "nope"), "no such checkpoint"
    elif case == "empty dir":
        (tmp_path / "empty").mkdir()
        target, expected = str(tmp_path / "empty"), "not a checkpoint"
    elif case == "a file":
        target, expected = str(path / "zerobridge.json"), "is a file, not a checkpoint directory"
    elif case == "corrupted":
        flip_byte(path / "__0_0.distcp")
        expected = "altered or corrupted"
    else:
        extra, expected = ["-o", str(tmp_path)], "is a directory"
    argv = ["checkpoint", "consolidate", target, *(extra or ["-o", str(tmp_path / "m.safetensors")])]
    if case != "output is a directory":
        argv = ["checkpoint", "info", target]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("zerobridge: error: ") and expected in err and "fix:" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- a save killed half way

def save_steps(path: str, steps: int) -> dict[str, torch.Tensor]:
    """World 1, stage 3: train ``steps`` steps, save with metadata {"step": steps}."""
    import zerobridge
    from zerobridge.testing.parity import ParityNet, batch, make_optimizer

    model = zerobridge.prepare(ParityNet(0), stage=3)
    optimizer = make_optimizer(list(model.named_parameters()), "adamw")
    for step in range(steps):
        model(*batch(step, 0, 8)).backward()
        optimizer.step()
        optimizer.zero_grad()
    zerobridge.save_checkpoint(path, model, optimizer, metadata={"step": steps})
    full: dict[str, torch.Tensor] = zerobridge.full_state_dict(model)
    return full


def die_during_save(path: str, where: str) -> None:
    """Save again, and SIGKILL this process half way (``write``: after a few data
    items; ``swap``: between moving the old checkpoint aside and the new one in)."""
    from zerobridge.checkpoint import storage, writer

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "write":
        resolve = writer._Planner.resolve_data
        calls = [0]

        def dying_resolve(self: Any, item: Any) -> Any:
            calls[0] += 1
            if calls[0] == 5:
                die()
            return resolve(self, item)
        writer._Planner.resolve_data = dying_resolve
    else:
        rename = os.rename

        def dying_rename(src: Any, dst: Any) -> None:
            rename(src, dst)
            if Path(src) == Path(path).absolute():
                die()
        storage._exchange = lambda a, b: False
        os.rename = dying_rename  # the worker dies right after; nothing else renames
    save_steps(path, 9)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[Any]:
    from zerobridge.harness.cluster import Cluster

    with Cluster(1, timeout_s=120) as cluster:
        yield cluster


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["write", "swap"])
def test_a_kill_during_save_leaves_the_previous_checkpoint(one_rank: Any, tmp_path: Path, where: str) -> None:
    from zerobridge.harness.cluster import RankError

    path = tmp_path / "ckpt"
    full = one_rank.run(f"{ME}:save_steps", path=str(path), steps=2)[0]
    with pytest.raises(RankError, match="killed by signal 9"):
        one_rank.run(f"{ME}:die_during_save", path=str(path), where=where)
    if where == "write":
        assert saving_dir(path).is_dir() and path.is_dir()  # the half-written save lies beside the checkpoint
    else:
        assert aside_dir(path).is_dir() and not path.exists()  # the kill landed between the two renames
    back = read_portable(path)  # recovers the aside copy, verifies every file
    assert back.metadata == {"step": 2}
    for name, value in full.items():
        assert torch.equal(back.model[name], value), name
    full = one_rank.run(f"{ME}:save_steps", path=str(path), steps=3)[0]  # the next save works
    assert read_portable(path).metadata == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    shutil.rmtree(path)
