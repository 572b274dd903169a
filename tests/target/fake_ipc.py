"""A CPU stand-in for feature_cuda_ipc.NativeIpcBackend: "device" tensors are CPU sn.Tensors, handles
are 64 random bytes registered in this process, events log their record / wait calls. Lets the
cuda-ipc transport's bookkeeping, handle checks, cleanup and the whole service path run without a GPU
(one process: the writer and the reader share the registry)."""
from __future__ import annotations

import os
import sys

import numpy as np

import specd.native as sn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))  # the tiled packers


class FakeEvent:
    def __init__(self, log: list, handle: bytes):
        self.log, self.handle = log, handle

    def record(self):
        self.log.append(("record", self.handle))

    def wait(self):
        self.log.append(("wait", self.handle))


class FakeIpcBackend:
    device = sn.Device.CPU
    registry: dict = {}  # handle -> tensor / event, shared by every instance (one process)
    log: list = []
    pci_bus_id = "0000:19:00.0"  # the "GPU" (a subclass or an instance may claim another)

    def device_id(self):
        return self.pci_bus_id

    def export(self, capacity, width):
        t = sn.Tensor.zeros([capacity, width], sn.DType.F32)
        h = os.urandom(64)
        self.registry[h] = t
        return t, h

    def open(self, handle, capacity, width, nbytes):
        t = self.registry.get(bytes(handle))
        if t is None:
            raise RuntimeError("fake IPC: unknown memory handle")
        assert tuple(t.shape) == (capacity, width) and t.nbytes == nbytes
        return t

    def export_tensor(self, t, tiled=False):
        """A CPU copy of ``t`` (any stored type) under a new handle (shared target weights); ``tiled``: in
        the GPU GEMV's tiled layout of its type, packed by test_gpu_gemv_tiles.py's numpy reference."""
        src = t.contiguous()
        if tiled:
            from test_gpu_gemv_tiles import FORMATS

            if src.dtype.name not in FORMATS:
                raise ValueError(f"fake IPC: no GEMV tiled layout for {src.dtype.name}")
            dtype, pack = FORMATS[src.dtype.name]
            d = sn.Tensor(np.ascontiguousarray(pack(src.numpy().reshape(src.shape[0], -1))), dtype)
        else:
            d = sn.Tensor(np.array(src.numpy(), copy=True), src.dtype)
        h = os.urandom(64)
        self.registry[h] = d
        self.log.append(("export_tensor", h))
        return d, h

    def open_tensor(self, handle, shape, dtype, nbytes):
        t = self.registry.get(bytes(handle))
        if t is None or not isinstance(t, sn.Tensor):
            raise RuntimeError("fake IPC: unknown memory handle")
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.nbytes != nbytes:
            raise ValueError(f"fake IPC: {t.dtype} {tuple(t.shape)} of {t.nbytes} bytes exported, "
                             f"asked {dtype} {tuple(shape)} of {nbytes} bytes")
        self.log.append(("open_tensor", bytes(handle)))
        return t

    def event_create(self):
        h = os.urandom(64)
        e = self.registry[h] = FakeEvent(self.log, h)
        return e

    def event_open(self, handle):
        e = self.registry.get(bytes(handle))
        if e is None:
            raise RuntimeError("fake IPC: unknown event handle")
        return e

    def synchronize(self):
        self.log.append(("sync", None))

    def forget(self, *handles):
        for h in handles:
            self.registry.pop(bytes(h), None)

    def empty(self, n, width):
        return sn.Tensor.zeros([n, width], sn.DType.F32)

    def upload(self, rows):
        return sn.Tensor(np.ascontiguousarray(rows, np.float32).copy())

    def copy_rows(self, dst, dst_start, src, src_start, n):
        sn.copy_rows(dst, dst_start, src, src_start, n)
