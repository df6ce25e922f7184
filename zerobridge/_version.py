"""The package version, in a module of its own so that anything may import it without a cycle.

    >>> from zerobridge._version import __version__
    >>> __version__.count(".")
    2
"""

__version__ = "0.1.0"
