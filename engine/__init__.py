"""OnePiece engine: the data plane, stages, workers, proxy and node manager.

Importing this package is cheap on purpose: no torch, no sockets, no
environment reads. Heavy pieces are imported by the modules that need them.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
