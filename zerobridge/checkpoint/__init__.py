"""Sharded checkpoints in ``torch.distributed.checkpoint`` format, resharded on load;
consolidated safetensors; a single-process portable reader and writer.

    >>> from zerobridge.checkpoint.portable import PortableState
    >>> sorted(PortableState.__dataclass_fields__)
    ['client_state', 'metadata', 'model', 'optimizer', 'param_groups', 'scheduler']

The format only: nothing here imports an engine or a backend (each backend
writes and reads its own part, ``backends/<name>/checkpoint.py``; the public
calls are in ``zerobridge.api``). Modules, each one concern: ``layout``
(keys, boxes), ``storage`` (manifest, checks, atomic swap), ``unpickle``
(restricted metadata reading), ``writer`` and ``reader`` (DCP planners),
``metadata`` (user metadata, layout, RNG keys), ``run_state`` (the LR
scheduler's state and the client state; restoring a scheduler),
``matching`` (checkpoint keys to a model and an optimizer), ``rng``
(generator states), ``full`` (safetensors), ``portable`` (whole tensors in
one process), ``deepspeed_import`` (DeepSpeed ZeRO checkpoints), ``cli``. Nothing is
re-exported here, so ``zerobridge checkpoint`` commands import torch only
when they run.
"""
