"""Backends: the engines a prepared model can run on (native, torch FSDP2, DeepSpeed).

``base`` holds the interface every backend implements; each engine has its
own module, imported only when chosen (``zerobridge.env`` names them).
"""

from zerobridge.backends.base import Backend, attach, backend_of, is_prepared

__all__ = ["Backend", "attach", "backend_of", "is_prepared"]
