"""Backends: the engines a prepared model can run on (native, torch FSDP2, DeepSpeed).

``base`` holds the interface and the choice of backend; each engine has its
own module, imported only when chosen.
"""

from zerobridge.backends.base import BACKEND_ENV, BACKENDS, Backend, attach, backend_of, is_prepared, resolve_backend

__all__ = ["BACKENDS", "BACKEND_ENV", "Backend", "attach", "backend_of", "is_prepared", "resolve_backend"]
