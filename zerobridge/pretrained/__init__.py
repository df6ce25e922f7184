"""Pretrained weights into a prepared model, each rank reading only its own runs (``zerobridge.load_pretrained``).

``files`` reads safetensors headers and byte ranges (and ``.bin``/``.pt``
state dicts), ``targets`` is the run a backend says it holds, ``load``
matches names and writes. No backend is imported here: each backend lists
its own targets (``Backend.pretrained_targets``).
"""
