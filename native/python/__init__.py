"""specd.native: the native kernel library (CPU backend, and CUDA/HIP when built with SPECD_GPU).

Tensors are :class:`Tensor` views of numpy arrays or device buffers; every op accepts numpy arrays
wherever it takes a Tensor (zero-copy on the CPU) and returns Tensors (``.numpy()`` to read them).
Each op's docstring gives shapes, dtypes, semantics and the source of its math.
"""
from ._native import *  # noqa: F401,F403
from ._native import DType, Device, Tensor  # noqa: F401
