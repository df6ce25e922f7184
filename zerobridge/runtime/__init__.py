"""The run rules every backend shares: what a spec means around whichever engine runs it.

The native engine, the torch FSDP2 backend and the DeepSpeed backend all
resolve a spec's dtypes, accumulation, clipping and loss scaling the same way
(``plan``), follow one accumulation window (``window``), clip and skip steps
by the same formulas (``step_rules``, ``loss_scale``), cut a model into the
same wrap units (``wrap_units``, ``unit_wrap``), compile them the same way
(``compile``), count communication in one convention (``comm_stats``),
find a tensor's local part and storage the same way (``tensors``), build
a meta-device model with eager values (``deferred_init``) and build a
DeepSpeed JSON's optimizer and scheduler as the torch objects that give
DeepSpeed's numbers (``optimizers``, ``lr_schedules``).

This package imports only ``zerobridge.spec``, ``zerobridge.errors`` and
``zerobridge.distributed`` (``tests/test_layers.py`` holds it to that): never
an engine or a backend.
"""
