"""Translators between the spec and every supported format.

    >>> from zerobridge.translate.formats import read_file, write   # doctest: +SKIP
    >>> spec = read_file("ds_config.json").value                    # doctest: +SKIP
    >>> write(spec, "fsdp2").report.render()                        # doctest: +SKIP

One reader module and one writer module per format (``deepspeed_read`` /
``deepspeed_write``, ``accelerate_read`` / ``accelerate_write`` (with
``accelerate_fsdp`` for the FSDP plugin and ``accelerate_common`` for what
they share), ``fsdp1``, ``fsdp2``, ``lightning``, ``torchtitan``), and the
shared pieces: ``fsdp_common`` (what the two FSDP readers share) and
``fsdp_write`` (what their writers share), ``compute_copy`` (which layout of
the 16-bit copy each flavor keeps), ``deepspeed_buckets`` (DeepSpeed's buckets
for a spec that leaves them to the engine, and their bytes), ``compilation`` (the compile settings of
each flavor), ``report``, ``mapping`` (tables in ``mappings/``), ``keys``
(reading a source's keys through its table), ``sources`` (parsing with
positions) and ``values`` (coercion). ``formats`` routes by format name.

The package is data in, data out: it never imports torch, and it imports only
``zerobridge.errors``, ``zerobridge.resources``, ``zerobridge.spec`` and its
own modules, each at module top. Live torch objects built from the FSDP forms
are in ``zerobridge.backends.fsdp.kwargs``; ``zerobridge.load.load_spec`` (a
strategy however it is named) sits above, beside ``zerobridge.registry``.
"""
