"""A non-editable install finds strategies/ and mappings/: the wheel ships them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(REPO)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No module named 'hatchling'" in proc.stderr:
        pytest.skip("hatchling is not installed in this environment")
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("zerobridge-*.whl")
    return path


def test_wheel_carries_every_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("strategies", "mappings"):
        shipped = {p.name for p in (REPO / folder).glob("*.toml")}
        assert shipped, folder
        for name in shipped:
            assert f"zerobridge/_data/{folder}/{name}" in names


def test_installed_copy_resolves_data_from_inside_the_package(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import zerobridge, zerobridge.resources as r; from zerobridge.registry import resolve;"
            "print(zerobridge.__file__); print(r.data_dir('strategies')); print(resolve('zero3').value.summary())")
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    module_file, data, summary = proc.stdout.splitlines()
    assert module_file.startswith(str(site)) and data.startswith(str(site / "zerobridge" / "_data"))
    assert summary.startswith("stage 3")
