"""zerobridge run: the ZEROBRIDGE_CONFIG grammar, the torchrun command, validation, one real launch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import zerobridge.launch as launch_module
from zerobridge.cli import _parser, main
from zerobridge.env import BACKEND as ENV_BACKEND
from zerobridge.env import COMPILE as ENV_COMPILE
from zerobridge.env import CONFIG as ENV_CONFIG
from zerobridge.env import PREPARED as ENV_PREPARED
from zerobridge.env import choice_from_env, decode_choice, encode_choice, mark_prepared
from zerobridge.errors import ConfigError
from zerobridge.launch import launch_env, torchrun_command

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

WORKER = '''\
import json, os, sys
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = os.path.join(sys.argv[1], f"rank{rank}.json")
record = {"rank": rank, "world_size": world, "ZEROBRIDGE_CONFIG": os.environ.get("ZEROBRIDGE_CONFIG"),
          "ZEROBRIDGE_BACKEND": os.environ.get("ZEROBRIDGE_BACKEND"), "argv": sys.argv[2:]}
with open(out + ".tmp", "w") as fh:
    json.dump(record, fh)
os.replace(out + ".tmp", out)
dist.destroy_process_group()
'''


def parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["run", *argv])


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Records launch attempts instead of starting processes."""
    started: list[list[str]] = []

    def fake_popen(cmd: list[str], **kwargs: object) -> None:
        started.append(cmd)
        raise AssertionError(f"a process was started: {cmd}")

    monkeypatch.setattr(launch_module.subprocess, "Popen", fake_popen)
    return started


# --- the ZEROBRIDGE_CONFIG grammar -------------------------------------------------------------

def test_encode_each_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert encode_choice(config=None, stage=None, strategy=None) is None
    assert encode_choice(config=None, stage=0, strategy=None) == "stage:0"
    assert encode_choice(config=None, stage=None, strategy="zero3-offload") == "strategy:zero3-offload"
    assert encode_choice(config="cfg/ds.json", stage=None, strategy=None) == f"config:{tmp_path / 'cfg' / 'ds.json'}"


@pytest.mark.parametrize("kwargs", [{"config": "a.json", "stage": 1, "strategy": None},
                                    {"config": None, "stage": 2, "strategy": "zero3"},
                                    {"config": "a.json", "stage": None, "strategy": "zero3"}])
def test_encode_rejects_two_choices(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="choose one of --config, --stage and --strategy"):
        encode_choice(**kwargs)  # type: ignore[arg-type]


def test_encode_rejects_bad_stage() -> None:
    with pytest.raises(ConfigError, match="0, 1, 2 or 3"):
        encode_choice(config=None, stage=4, strategy=None)


def test_decode_prefixed_values() -> None:
    assert decode_choice("stage:3") == ("stage", 3)
    assert decode_choice("strategy:zero3") == ("strategy", "zero3")
    assert decode_choice("config:/abs/path.json") == ("config", "/abs/path.json")
    assert decode_choice(" strategy:fsdp2 ") == ("strategy", "fsdp2")


def test_decode_bare_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text("{}")
    assert decode_choice("ds.json") == ("config", str(tmp_path / "ds.json"))
    assert decode_choice(str(tmp_path / "ds.json")) == ("config", str(tmp_path / "ds.json"))
    assert decode_choice("2") == ("stage", 2)
    assert decode_choice("4") == ("strategy", "4")  # Accelerate's sharding codes are strategy names
    assert decode_choice("zero2-offload") == ("strategy", "zero2-offload")
    assert decode_choice("missing.json") == ("strategy", "missing.json")


@pytest.mark.parametrize("value", ["", "stage:", "stage:7", "stage:two", "config:  "])
def test_decode_rejects_bad_values(value: str) -> None:
    with pytest.raises(ConfigError):
        decode_choice(value)


@pytest.mark.parametrize("kwargs", [{"stage": 1}, {"strategy": "zero3"}, {"config": "/tmp/x.yaml"}])
def test_encode_decode_round_trip(kwargs: dict[str, object]) -> None:
    full: dict[str, object] = {"config": None, "stage": None, "strategy": None, **kwargs}
    encoded = encode_choice(**full)  # type: ignore[arg-type]
    assert encoded is not None
    (kind, value), = kwargs.items()
    assert decode_choice(encoded) == (kind, value)
    assert choice_from_env({ENV_CONFIG: encoded}) == (kind, value)
    assert choice_from_env({}) is None


# --- arguments -> torchrun command ---------------------------------------------------------------

def test_only_given_flags_are_passed(script: Path) -> None:
    assert torchrun_command(parse(str(script))) == [*TORCHRUN, str(script)]
    args = parse("--nproc", "2", "--nnodes", "1:4", "--node-rank", "0", "--master-addr", "10.0.0.1",
                 "--master-port", "29501", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:1234",
                 "--rdzv-id", "job7", "--max-restarts", "3", "--standalone", str(script), "a", "--b")
    assert torchrun_command(args) == [
        *TORCHRUN, "--nnodes", "1:4", "--nproc-per-node", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
        "--master-port", "29501", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:1234", "--rdzv-id", "job7",
        "--max-restarts", "3", "--standalone", str(script), "a", "--b"]


@pytest.mark.parametrize(("flags", "expected"), [
    ((), ["--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]),
    (("--master-port", "29511"),
     ["--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29511"]),
    (("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"),
     ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
      "--rdzv-endpoint", "10.0.0.1:29500"]),
    (("--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379"),
     ["--nproc-per-node", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379", "--max-restarts", "1"]),
])
def test_restarts_get_a_fresh_rendezvous_store_per_attempt(flags: tuple[str, ...], expected: list[str]) -> None:
    """torchrun's static rendezvous shares one store across attempts, whose stale addresses refuse the restarted
    workers: with --max-restarts the launch uses c10d (a given rendezvous is kept) and no shared store."""
    args = parse("--nproc", "2", *flags, "--max-restarts", "1", "train.py")
    assert torchrun_command(args, python="py") == ["py", "-m", "torch.distributed.run", *expected, "train.py"]
    assert launch_env(args, base={})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch_env(parse("--nproc", "2", "train.py"), base={})


def test_flags_after_the_script_belong_to_the_script() -> None:
    args = parse("--nproc", "2", "--stage", "1", "train.py", "--stage", "3", "--nproc", "x", "-h", "--", "-m")
    assert args.stage == 1 and args.nproc == "2"
    assert torchrun_command(args, python="py") == [
        "py", "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "train.py", "--stage", "3", "--nproc", "x", "-h", "--", "-m"]


def test_module_mode_and_leading_double_dash() -> None:
    args = parse("-m", "mypkg.train", "--epochs", "1")
    assert torchrun_command(args, python="py") == ["py", "-m", "torch.distributed.run", "--module", "mypkg.train",
                                                   "--epochs", "1"]
    assert parse("--nproc", "2", "--", "train.py", "x").script_args == ["x"]


def test_environment_carries_choice_and_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = launch_env(parse("--config", "ds.json", "--backend", "fsdp", "t.py"), base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", ENV_CONFIG: f"config:{tmp_path / 'ds.json'}", ENV_BACKEND: "fsdp"}
    inherited = {ENV_CONFIG: "stage:1"}
    assert launch_env(parse("t.py"), base=inherited) == inherited
    assert launch_env(parse("--stage", "3", "t.py"), base=inherited)[ENV_CONFIG] == "stage:3"


def test_compile_flag_travels_to_the_workers() -> None:
    assert launch_env(parse("--compile", "t.py"), base={})[ENV_COMPILE] == "1"
    assert ENV_COMPILE not in launch_env(parse("t.py"), base={})
    assert parse("t.py", "--compile").script_args == ["--compile"], "after the script it is the script's"


def test_compile_on_deepspeed_stage3_is_checked_before_launch(script: Path, capsys: pytest.CaptureFixture[str],
                                                             no_launch: list[list[str]]) -> None:
    argv = ["run", "--nproc", "2", "--strategy", "zero3", "--backend", "deepspeed", "--compile", str(script)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "compile.scope" in err and "--allow-approximate" in err and not no_launch


@pytest.mark.parametrize("argv", [("--stage", "2", "--strategy", "zero3", "t.py"),
                                  ("--config", "a.json", "--stage", "1", "t.py"),
                                  ("--stage", "5", "t.py"), ("--backend", "megatron", "t.py"),
                                  ("--nproc", "0", "t.py"), ("--master-port", "70000", "t.py"), ()])
def test_bad_arguments_exit_2(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str],
                              no_launch: list[list[str]]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", *argv])
    assert exc.value.code == 2 and not no_launch
    assert "zerobridge run: error:" in capsys.readouterr().err


# --- validation before launch -------------------------------------------------------------------

def test_bad_config_file_exits_2_without_launching(tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str],
                                                   no_launch: list[list[str]]) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 3, "overlap_com": true}}')
    assert main(["run", "--nproc", "2", "--config", str(bad), str(script)]) == 2
    err = capsys.readouterr().err
    assert "overlap_com" in err and "overlap_comm" in err and "Traceback" not in err
    assert not no_launch


@pytest.mark.parametrize("argv, message", [
    (("--config", "no-such.json"), "config file not found"),
    (("--strategy", "zero9"), "neither a file nor a strategy name"),
])
def test_unloadable_choice_exits_2(argv: tuple[str, ...], message: str, script: Path,
                                   capsys: pytest.CaptureFixture[str], no_launch: list[list[str]]) -> None:
    assert main(["run", *argv, str(script)]) == 2
    assert message in capsys.readouterr().err and not no_launch


def test_missing_script_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                no_launch: list[list[str]]) -> None:
    assert main(["run", "--stage", "1", str(tmp_path / "nope.py")]) == 2
    assert "training script not found" in capsys.readouterr().err and not no_launch


def test_exit_code_is_the_launchers(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    class FakeProc:
        def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
            seen.update(cmd=cmd, env=env)

        def wait(self) -> int:
            return 3

    monkeypatch.setattr(launch_module.subprocess, "Popen", FakeProc)
    assert main(["run", "--strategy", "zero3", "--backend", "native", str(script), "x"]) == 3
    assert seen["cmd"] == [*TORCHRUN, str(script), "x"]
    env = seen["env"]
    assert isinstance(env, dict) and env[ENV_CONFIG] == "strategy:zero3" and env[ENV_BACKEND] == "native"


# --- a script that never calls prepare ---------------------------------------------------------

class _Script:
    """Stands in for torchrun: exits with ``code``, calling ``prepare`` (creating the marker) or not."""

    def __init__(self, code: int, prepares: bool) -> None:
        self.code, self.prepares = code, prepares
        self.env: dict[str, str] = {}

    def __call__(self, cmd: list[str], env: dict[str, str]) -> _Script:
        self.env = env
        return self

    def wait(self) -> int:
        if self.prepares:
            mark_prepared(self.env)
        return self.code


@pytest.mark.parametrize("code, prepares, warned", [(0, False, True), (0, True, False), (3, False, False)])
def test_a_script_that_never_prepares_is_warned_about_and_keeps_its_exit_code(
        code: int, prepares: bool, warned: bool, script: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = _Script(code, prepares)
    monkeypatch.setattr(launch_module.subprocess, "Popen", fake)
    assert main(["run", "--stage", "3", "--backend", "fsdp", str(script)]) == code
    err = capsys.readouterr().err
    assert ("exited without calling zerobridge.prepare on this node, so --stage 3 --backend fsdp had no effect"
            in err) is warned
    assert ("fix: prepare the model in the script" in err) is warned
    marker = Path(fake.env[ENV_PREPARED])
    assert not marker.parent.exists(), "the launcher's marker directory is removed"


def test_no_warning_when_the_launcher_chose_nothing(script: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(launch_module.subprocess, "Popen", _Script(0, prepares=False))
    assert main(["run", "--nproc", "1", str(script)]) == 0  # zerobridge run as plain torchrun: nothing went unused
    assert "zerobridge.prepare" not in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("prepares", [False, True])
def test_real_launch_warns_only_when_prepare_was_never_called(tmp_path: Path, prepares: bool) -> None:
    script = tmp_path / "train.py"
    prepare = "zerobridge.prepare(torch.nn.Linear(2, 2))\ntorch.distributed.destroy_process_group()\n"
    script.write_text("import torch, zerobridge\n" + (prepare if prepares else "") + "print('done')\n")
    done = subprocess.run([sys.executable, "-m", "zerobridge.cli", "run", "--standalone", "--nproc", "1",
                           "--backend", "fsdp", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
    assert ("exited without calling zerobridge.prepare" in done.stderr) is not prepares, done.stderr[-3000:]


# --- one real launch ----------------------------------------------------------------------------

@pytest.mark.slow
def test_real_launch_two_gloo_workers(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "zerobridge.cli", "run", "--standalone", "--nproc", "2", "--stage", "2",
           "--backend", "native", str(worker), str(out), "--stage", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    records = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    # Judge by the files: gloo occasionally aborts at interpreter exit after the work is done.
    assert set(records) == {"rank0.json", "rank1.json"}, (proc.returncode, proc.stderr[-3000:])
    for rank in (0, 1):
        assert records[f"rank{rank}.json"] == {"rank": rank, "world_size": 2, "ZEROBRIDGE_CONFIG": "stage:2",
                                               "ZEROBRIDGE_BACKEND": "native", "argv": ["--stage", "0"]}
