"""Real DeepSpeed as a backend (``backend="deepspeed"``): ``prepare``, ``backend``, ``step``,
``checkpoint``, ``materialize``, with ``config`` (the DeepSpeed JSON the backend runs) and
``internals`` (the one module that touches DeepSpeed's private attributes)."""
