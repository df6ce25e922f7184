"""The native engine as a backend (``backend="native"``, the default): ``prepare``, ``backend``,
``checkpoint``, ``materialize``, ``targets``. The engine itself is ``zerobridge/engine/``; its
stepper stays there, because the engine's hooks drive it."""
