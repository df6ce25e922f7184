"""torch FSDP2 as a backend (``backend="fsdp"``): ``prepare``, ``backend``, ``step``,
``checkpoint``, ``materialize``, ``targets``, with ``apply`` (the ordered ``apply_*`` steps),
``assess`` (what FSDP2 runs exactly, approximately, or refuses) and ``kwargs`` (the live
``fully_shard`` and FSDP1 keywords, also for scripts that call torch FSDP themselves)."""
