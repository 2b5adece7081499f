"""Tensors <-> Flower's ArrayRecords, the one place the wire's arrays are encoded and decoded
(the names they travel under are common/protocol.py's).

An array travels as an npy blob (``numpy.ndarray`` stype, no pickles), as ``Array(value)``
makes it; decoding reads a blob with the exact header np.save writes in place.
"""

from __future__ import annotations

import functools
import io
import math
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

NUMPY_STYPE = "numpy.ndarray"  # the only array serialisation the server decodes


@functools.lru_cache(maxsize=1024)
def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The bytes ``np.save`` writes before the data of a C-ordered ``dtype[shape]`` array."""
    blob = io.BytesIO()
    value = np.empty(shape, dtype=np.dtype(dtype))
    np.save(blob, value, allow_pickle=False)
    return blob.getvalue()[: len(blob.getvalue()) - value.nbytes]


def as_array(value: np.ndarray) -> Array:
    """A numpy array -> the Array ``Array(value)`` makes (an npy blob), without np.save's
    per-call header formatting."""
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)  # (ascontiguousarray makes a 0-d array 1-d)
    dtype, shape = value.dtype.str, value.shape
    return Array(dtype=_DTYPE_NAMES[dtype], shape=shape, stype=NUMPY_STYPE,
                 data=npy_header(dtype, shape) + value.tobytes())


class _DtypeNames(dict):
    """numpy's dtype strings ('<f4') -> its names ('float32'), as ``str(dtype)`` gives them
    (which costs microseconds each time)."""

    def __missing__(self, key: str) -> str:
        self[key] = str(np.dtype(key))
        return self[key]


_DTYPE_NAMES = _DtypeNames()


def array_data(arr: Array, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """An Array's numpy value (read-only). An npy blob whose header is exactly the one np.save
    writes for ``dtype[shape]`` (default: what the Array declares) is read in place, without
    np.load's header parse; any other blob goes through ``np.load`` (no pickles)."""
    dtype = str(arr.dtype) if dtype is None else dtype
    shape = tuple(arr.shape) if shape is None else shape
    try:
        header = npy_header(dtype, shape)
        size = np.dtype(dtype).itemsize * math.prod(shape)
    except (TypeError, ValueError):  # not a dtype or shape numpy knows: the general path
        header, size = None, -1
    data = arr.data
    if header is not None and len(data) == len(header) + size and data.startswith(header):
        return np.frombuffer(data, dtype=np.dtype(dtype), offset=len(header)).reshape(shape)
    return np.load(io.BytesIO(data), allow_pickle=False)


def to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors -> ArrayRecord (order kept, copied to CPU numpy). Filled item by item:
    ``ArrayRecord(dict)`` would build every Array a second time."""
    record = ArrayRecord()
    for name, t in tensors.items():
        record[name] = as_array(t.detach().cpu().numpy())
    return record


def from_record(record: ArrayRecord) -> OrderedDict[str, torch.Tensor]:
    """ArrayRecord -> named tensors (CPU, writable copies)."""
    return OrderedDict((name, torch.from_numpy(array_data(arr).copy())) for name, arr in record.items())


def payload_bytes(content: RecordDict) -> int:
    """Bytes of all array payloads in a message (what the model traffic costs). Read in one
    pass over the content: Flower's typed view ``content.array_records`` builds a new dict."""
    return sum(rec.count_bytes() for rec in content.values() if isinstance(rec, ArrayRecord))
