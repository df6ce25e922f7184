"""DeepSpeed's own classes in the files a DeepSpeed checkpoint holds, written by name without importing DeepSpeed.

    >>> import pathlib, tempfile
    >>> from zerobridge.checkpoint.deepspeed_pickle import ZeroStage, save
    >>> path = pathlib.Path(tempfile.mkdtemp(), "optim_states.pt")
    >>> save({"zero_stage": ZeroStage(2)}, path)
    >>> b"deepspeed.runtime.zero.config" in path.read_bytes()
    True

DeepSpeed pickles three of its objects into its checkpoints (the loss scaler, the ZeRO stage enum, fragment
addresses) and reads them back with ``torch.load(weights_only=False)``. The stand-ins here carry the same
attributes and are written under DeepSpeed's module and class names (``Foreign.where``) by a pickler that
emits the name only, so DeepSpeed resolves its own classes on load (``deepspeed_export.py``).
"""

from __future__ import annotations

import os
import pickle
import types
from pathlib import Path
from typing import Any, ClassVar

import torch

__all__ = ["Foreign", "FragmentAddress", "LossScaler", "ZeroStage", "save"]


class Foreign:
    """A stand-in pickled under one of DeepSpeed's class names (``where``), so DeepSpeed's own
    ``torch.load(weights_only=False)`` builds its class from it; nothing here imports DeepSpeed."""

    where: ClassVar[tuple[str, str]]


class LossScaler(Foreign):
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler``: the static scaler fp32 runs keep (scale 1)."""

    where = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = scale
        self.dynamic = False


class FragmentAddress(Foreign):
    """``deepspeed.utils.tensor_fragment.fragment_address``: where a parameter's piece lies in a partition."""

    where = ("deepspeed.utils.tensor_fragment", "fragment_address")

    def __init__(self, numel: int, start: int) -> None:
        self.numel = numel
        self.start = start


class ZeroStage(Foreign):
    """``deepspeed.runtime.zero.config.ZeroStageEnum(stage)``, pickled as an enum is: the class called on its value."""

    where = ("deepspeed.runtime.zero.config", "ZeroStageEnum")

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def __reduce__(self) -> tuple[type[ZeroStage], tuple[int]]:
        return type(self), (self.stage,)


class _Pickler(pickle._Pickler):
    """Python's own pickler, writing a ``Foreign`` class as a GLOBAL of the name it stands for. (The C
    pickler looks every global up to check it; this one is told the name instead.)"""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if not (isinstance(obj, type) and issubclass(obj, Foreign)):
            super().save_global(obj, name)  # type: ignore[misc]  # undocumented method of pickle._Pickler
            return
        module, qualname = obj.where
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("ascii"))  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


_PICKLE_MODULE = types.ModuleType(f"{__name__}.pickle")
"""What ``torch.save(pickle_module=...)`` takes: a module with ``__name__`` and ``Pickler``."""
_PICKLE_MODULE.Pickler = _Pickler  # type: ignore[attr-defined]


def save(obj: dict[str, Any], path: Path) -> None:
    """``torch.save`` of ``obj`` to ``path`` with the stand-ins written under DeepSpeed's names, synced to disk
    before it returns."""
    with path.open("wb") as fh:
        torch.save(obj, fh, pickle_module=_PICKLE_MODULE)
        fh.flush()
        os.fsync(fh.fileno())
