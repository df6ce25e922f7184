"""Backends: the engines a prepared model can run on, one folder each with the same file names.

``base`` holds the interface every backend implements (``Backend``) and what
they share (``backend_of``, ``set_backend``, ``check_fresh``,
``adopt_class``). ``native/``, ``fsdp/`` and ``deepspeed/`` each have a
``prepare.py`` (the ordered steps that put a model on that engine), a
``backend.py`` (the ``Backend`` the public API asks), a ``checkpoint.py``, a
``materialize.py`` (meta-device models) and, where the backend has one, a
``step.py`` (its stepper around the shared accumulation window) and a
``targets.py`` (``load_pretrained``). ``preflight`` decides before launch
whether a backend can run a spec. Nothing is re-exported here, so the
launcher can read ``preflight`` without loading torch.
"""
