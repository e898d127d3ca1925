"""zero: ZeRO and ZeRO-Offload for PyTorch.

`import zero` is cheap: native ops are compiled on first use (see zero/ops/builder.py).
"""
__version__ = "0.1.0"
