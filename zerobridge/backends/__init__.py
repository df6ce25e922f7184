"""Backends: the engines a prepared model can run on (native, torch FSDP2, DeepSpeed).

``base`` holds the interface and the choice of backend; each engine has its
own module, imported only when chosen.
"""

from zerobridge.backends.base import (
    APPROXIMATE_ENV, BACKEND_ENV, BACKENDS, COMPILE_ENV, Backend, attach, backend_of, is_prepared,
    resolve_allow_approximate, resolve_backend, resolve_compile,
)

__all__ = ["APPROXIMATE_ENV", "BACKENDS", "BACKEND_ENV", "COMPILE_ENV", "Backend", "attach", "backend_of", "is_prepared",
           "resolve_allow_approximate", "resolve_backend", "resolve_compile"]
