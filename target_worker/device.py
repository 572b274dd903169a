"""Device plumbing shared by the target (target_worker/model.py) and the drafter
(draft_worker/model.py).

A forward graph is written once against a small "array plumbing" interface (``ops``): results of
native ops are turned into the model's working arrays by ``ops.a``, and the few operations the
graph does outside the native ops (reshape, row gathers, concatenation, copies, a scalar scale,
host <-> device moves) go through ``ops``.
:class:`_HostOps` is the CPU path: numpy, exactly the operations the CPU forwards have always done
(bit for bit). :class:`_TensorOps` keeps everything as sn.Tensor on the model's device, using the
native glue ops (sn.slice / concat / copy / copy_rows, sn.embedding as an exact row gather, and
sn.mul broadcasting a [1, H] table over rows), so no activation leaves the GPU. :class:`_Uploader` places weights on the device once (tensors already
there are taken as they are, e.g. a same-process target's embedding / lm_head shared with the
drafter).
"""
from __future__ import annotations

import dataclasses

import numpy as np

import specd.native as sn

def parse_device(device) -> "sn.Device":
    """``sn.Device`` from a Device or "cpu" / "cuda" / "gpu" / "hip". Asking for the GPU raises
    RuntimeError when this build has no GPU backend or no device is present."""
    if isinstance(device, str):
        name = device.strip().lower()
        if name not in ("cpu", "cuda", "gpu", "hip"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        device = sn.Device.CPU if name == "cpu" else sn.Device.GPU
    if device == sn.Device.GPU:
        if not sn.gpu_compiled():
            raise RuntimeError("device cuda requested, but specd was built without a GPU backend "
                               "(reinstall with SPECD_GPU=cuda, or SPECD_GPU=hip for AMD)")
        if not sn.gpu_available():
            raise RuntimeError(f"device cuda requested, but no GPU is usable ({sn.gpu_backend()} build)")
    elif device != sn.Device.CPU:
        raise ValueError(f"device must be sn.Device.CPU or sn.Device.GPU, got {device!r}")
    return device


def default_device() -> str:
    """"cuda" when this build has a GPU backend and a device is present, else "cpu"."""
    return "cuda" if sn.gpu_available() else "cpu"


class _HostOps:
    """numpy plumbing (the CPU forward)."""

    @staticmethod
    def a(t):
        return t.numpy()

    @staticmethod
    def reshape(x, *shape):
        return x.reshape(shape)

    @staticmethod
    def take(x, rows):
        return x[np.asarray(rows, np.int64)]

    @staticmethod
    def cat(xs, axis=0):
        return np.concatenate(xs, axis=axis)

    @staticmethod
    def copy(x):
        return x.copy()

    @staticmethod
    def tail_rows(x, n):
        return x[-n:].copy()

    @staticmethod
    def last_row(x):
        return x[-1:]

    @staticmethod
    def lead_rows(x, n):
        """Rows [0, n) of x without a copy (a numpy view)."""
        return x[:n]

    @staticmethod
    def host(x):
        return x

    @staticmethod
    def zeros(shape):
        return np.zeros(shape, np.float32)

    @staticmethod
    def empty(shape):
        """An uninitialised F32 array (an op's output argument)."""
        return np.empty(shape, np.float32)

    @staticmethod
    def move_rows(cache, moved):
        raw = cache.numpy()
        for src, dst in moved:
            raw[dst] = raw[src]

    @staticmethod
    def assign(dst, src):  # noqa: ARG004
        """The new value of a state slot: numpy arrays are simply replaced (src itself)."""
        return src

    @staticmethod
    def indices(*arrays):
        """Host int32 index arrays as the ops take them (numpy: as they are)."""
        return list(arrays)

    # --- used by the drafter (draft_worker/model.py)

    @staticmethod
    def put(x):
        """A host float32 array as the model's working array (numpy: as it is, contiguous)."""
        return np.ascontiguousarray(x, np.float32)

    @staticmethod
    def rows(x, start, stop):
        return x[start:stop]

    @staticmethod
    def scale(x, s):
        return (x * np.float32(s)).astype(np.float32)

    @staticmethod
    def softcap(x, c):
        c = np.float32(c)
        return (np.tanh(x / c) * c).astype(np.float32)

    @staticmethod
    def kv_view(cache, start, stop, dtype):
        """Rows [start, stop) of a KV cache as a native view (zero-copy)."""
        if dtype == sn.DType.Q8_0:
            return sn.Tensor(cache.numpy()[start:stop], dtype)
        return sn.Tensor(cache.numpy()[start:stop])

    @staticmethod
    def shift_rows(cache, dst, src, n):
        """Rows [src, src + n) of a cache moved to [dst, dst + n) (ranges may overlap)."""
        a = cache.numpy()
        a[dst : dst + n] = a[src : src + n].copy()


class _TensorOps:
    """sn.Tensor plumbing on one device: every intermediate stays there. Values equal _HostOps'
    exactly (byte copies, exact gathers, F32 add/mul rounded once like numpy's)."""

    def __init__(self, device):
        self.device = device
        self._consts: dict[tuple[float, int], sn.Tensor] = {}

    @staticmethod
    def a(t):
        return t

    @staticmethod
    def reshape(x, *shape):
        return x.reshape(list(shape))

    def take(self, x, rows):
        rows = [int(r) for r in rows]
        n = x.shape[0]
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):  # a run of rows: one copy
            return sn.slice(x, 0, rows[0], rows[0] + len(rows))
        inner = list(x.shape[1:])
        flat = x.reshape([n, int(np.prod(inner, dtype=np.int64))])
        y = sn.embedding(flat, np.asarray(rows, np.int32))  # exact row gather (F32)
        return y.reshape([len(rows)] + inner)

    @staticmethod
    def cat(xs, axis=0):
        return sn.concat(list(xs), axis)

    @staticmethod
    def copy(x):
        return sn.copy(x)

    @staticmethod
    def tail_rows(x, n):
        return sn.slice(x, 0, x.shape[0] - n, x.shape[0])

    @staticmethod
    def last_row(x):
        return sn.slice(x, 0, x.shape[0] - 1, x.shape[0])

    @staticmethod
    def lead_rows(x, n):
        """Rows [0, n) of a contiguous x without a copy (a view sharing its memory: no launch)."""
        return x.view_rows(0, n)

    @staticmethod
    def host(x):
        return x.numpy()

    def zeros(self, shape):
        return sn.Tensor.zeros(list(shape), sn.DType.F32, self.device)

    def empty(self, shape):
        """An uninitialised F32 tensor on the device (an op's output argument)."""
        return sn.Tensor.empty(list(shape), sn.DType.F32, self.device)

    @staticmethod
    def move_rows(cache, moved):
        for src, dst in moved:
            sn.copy_rows(cache, dst, cache, src, 1)

    @staticmethod
    def assign(dst, src):
        """Copies src into dst in place and returns dst: state tensors keep their device address
        (a captured GPU graph reads them there)."""
        sn.copy_rows(dst, 0, src, 0, dst.shape[0])
        return dst

    def indices(self, *arrays):
        """Host int32 index arrays as device tensors: one packed upload (asynchronous, through the
        library's pinned staging memory on the GPU), returned as zero-copy views."""
        packed = np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in arrays])
        if self.device == sn.Device.CPU:
            buf = sn.Tensor(packed)
        else:
            buf = sn.Tensor.empty([packed.size], sn.DType.I32, self.device)
            sn.gpu_write_async(buf, packed)
        out, start = [], 0
        for a in arrays:
            out.append(buf.view_rows(start, start + len(a)))
            start += len(a)
        return out

    # --- used by the drafter (draft_worker/model.py)

    def put(self, x):
        if isinstance(x, sn.Tensor):
            return x
        t = sn.Tensor(np.ascontiguousarray(x, np.float32))
        return t if self.device == sn.Device.CPU else t.to(self.device)

    @staticmethod
    def rows(x, start, stop):
        return sn.slice(x, 0, start, stop)

    def scale_table(self, value, width):
        """The [1, width] F32 table of float32(value) that :meth:`scale` multiplies by (uploaded once,
        cached; the drafter makes its tables before any CUDA graph capture, which cannot upload)."""
        key = (float(np.float32(value)), int(width))
        t = self._consts.get(key)
        if t is None:
            t = self.put(np.full((1, width), np.float32(value), np.float32))
            self._consts[key] = t
        return t

    def scale(self, x, s):
        """x * float32(s), elementwise (one F32 rounding, as numpy's)."""
        shape = list(x.shape)
        flat = x.reshape([shape[0], int(np.prod(shape[1:], dtype=np.int64))])
        return sn.mul(flat, self.scale_table(s, flat.shape[1])).reshape(shape)

    def softcap(self, x, c):
        """tanh(x / c) * c. No native tanh yet: computed on the host (numpy, as the CPU path) and
        put back; only drafters with final_logit_softcapping take this round trip."""
        return self.put(_HostOps.softcap(x.numpy(), c))

    def kv_view(self, cache, start, stop, dtype):  # noqa: ARG002
        """Rows [start, stop): a device copy (sn.slice) unless start == 0 — attention reads only the
        first kv_len rows of a cache, so the whole cache is passed then (no copy)."""
        return cache if start == 0 else sn.slice(cache, 0, start, stop)

    @staticmethod
    def shift_rows(cache, dst, src, n):
        if n <= 0 or dst == src:
            return
        tmp = sn.slice(cache, 0, src, src + n)  # a copy: the ranges may overlap
        sn.copy_rows(cache, dst, tmp, 0, n)


# Placed by the models themselves in another layout: the target's GDN conv kernel and gate vectors,
# the DFlash 2 convolutions' base kernels.
_PLACED_BY_MODEL = ("ssm_conv1d", "ssm_a", "ssm_dt", "attn_conv_base", "ffn_conv_base")


_TILED_SOURCES = (sn.DType.IQ4_XS, sn.DType.Q4_K, sn.DType.Q5_K, sn.DType.Q6_K)  # what sn.tile_for_gemv regroups


class _Uploader:
    """Places the weights on the model's device once, in their stored type (the GPU matmul and
    embedding decode every type the loaders accept; the CPU with tensor_ops: as they are).

    gemv_tiles: on a GPU whose GEMV reads it (``sn.gemv_tiles_supported()``: CUDA builds), the
    layers' IQ4_XS, Q4_K, Q5_K and Q6_K matrices with a multiple of 16 rows are placed in the tensor-core GEMV's
    tiled layouts (``sn.tile_for_gemv``: the same blocks regrouped, bit-identical matmul results, faster GEMV on the
    H200: BENCHMARKS.md), and so is an output head that is not tied to the embedding (:meth:`head`); the
    embedding stays row-major (row gathers).
    Default False (the drafter's uploads); the target model passes its ``gemv_tiles`` option. A
    source already on the device is tiled into a copy (the row-major original stays with its owner).
    """

    def __init__(self, device, gemv_tiles: bool = False):
        self.device = device
        self.gemv_tiles = bool(gemv_tiles) and device == sn.Device.GPU and sn.gemv_tiles_supported()
        self._placed: dict = {}  # id(source) -> (source, placed): a tied output is uploaded once
        self._staging: dict = {}  # (dtype, in) -> device staging buffer of _staged

    def plain(self, t):
        t = t if isinstance(t, sn.Tensor) else sn.Tensor(t)
        if id(t) not in self._placed:
            if t.device == self.device:  # already there (a same-process target's tensors): shared
                self._placed[id(t)] = (t, t)
                return t
            placed = t if self.device == sn.Device.CPU else t.contiguous().to(self.device)
            self._placed[id(t)] = (t, placed)
        return self._placed[id(t)][1]

    matmul = plain      # a matmul weight (any storage type)
    embedding = plain   # a row-gather table (any storage type)

    def tiles(self, t) -> bool:
        """Whether matmul weight t [out, in] is placed in the GEMV's tiled layout (gemv_tiles, a format
        sn.tile_for_gemv regroups, whole 16-row tiles)."""
        return self.gemv_tiles and t.dtype in _TILED_SOURCES and len(t.shape) == 2 and t.shape[0] % 16 == 0

    def tiles_head(self, output, token_embd) -> bool:
        """Whether the output head is placed tiled: :meth:`tiles`, and not the embedding itself (a tied head
        is one row-major copy for both: the embedding gathers rows)."""
        return output is not token_embd and self.tiles(output)

    def head(self, output, token_embd):
        """The output head: tiled where :meth:`tiles_head` says so (from a temporary device copy of its row-major
        bytes, freed right after, not a staging buffer kept for the layers: the caller places the head after
        them, so the pool's trim returns that block), else as :meth:`plain`."""
        if not self.tiles_head(output, token_embd):
            return self.plain(output)
        return self._tiled(output, staged=False)

    def layer_matmul(self, t):
        """A layer's matmul weight: tiled for the GEMV where gemv_tiles applies (:meth:`tiles`; from the
        row-major bytes in a reused staging buffer, :meth:`_staged`), else as :meth:`plain`."""
        if not self.tiles(t):
            return self.plain(t)
        return self._tiled(t, staged=True)

    def _tiled(self, t, staged: bool):
        """sn.tile_for_gemv of t, once per source (its own entry: plain() / embedding() of the same source stay
        row-major); a host t reaches the device through :meth:`_staged` (staged) or a temporary copy."""
        key = ("tiled", id(t))
        if key not in self._placed:
            src = t.contiguous()
            if src.device != self.device:
                src = self._staged(src) if staged else src.to(self.device)
            self._placed[key] = (t, sn.tile_for_gemv(src))
        return self._placed[key][1]

    def _staged(self, t):
        """Host matrix t [out, in] copied into a device staging buffer reused for every matrix of
        its type and row size (grown to the largest out): the row-major copy only feeds
        sn.tile_for_gemv. A fresh pool block per matrix would, once freed, be split by the smaller
        allocations that follow and could no longer be returned (H200, 27B IQ4_XS: 1.7 GiB held
        after sn.gpu_trim_pool); :meth:`release_staging` frees the buffers."""
        out, key = t.shape[0], (t.dtype, t.shape[1])
        if key not in self._staging or self._staging[key].shape[0] < out:
            self._staging.pop(key, None)  # a smaller buffer goes before the larger one is allocated
            self._staging[key] = sn.Tensor.empty([out, t.shape[1]], t.dtype, self.device)
        buf = self._staging[key]
        view = buf.view_rows(0, out)
        sn.gpu_write_async(view, t.numpy())  # stream-ordered after the tiling that last read it
        return view

    def release_staging(self):
        """Frees the staging buffers of :meth:`_staged` (call once the layers are placed)."""
        self._staging.clear()

    def layer(self, layer):
        fields = {}
        for f in dataclasses.fields(layer):
            t = getattr(layer, f.name)
            if not isinstance(t, sn.Tensor) or f.name in _PLACED_BY_MODEL:
                continue
            is_vector = len(t.shape) == 1
            fields[f.name] = self.plain(t) if is_vector else self.layer_matmul(t)
        return _PlacedLayer(**fields)


class _PlacedLayer:
    """A layer's weights on the model's device (attribute access like the loader's layers)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
