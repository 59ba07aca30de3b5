"""The ctypes mirror of dlpack.h (exchange/_dlpack_abi.py) against the DLPack 1.3 ABI on
64-bit Linux: every struct's size and alignment, every field's offset and size, and the
enum and flag values (DLPack 1.3's include/dlpack/dlpack.h)."""

from __future__ import annotations

import ctypes
import struct

import pytest

import exchange as tx
from exchange import _dlpack_abi as abi

pytestmark = pytest.mark.skipif(struct.calcsize("P") != 8, reason="the ABI table is for 64-bit (LP64) platforms")

# (struct, size, alignment, [(field, offset, size), ...]) from dlpack.h 1.3 on LP64.
LAYOUT = [
    (abi.DLPackVersion, 8, 4, [("major", 0, 4), ("minor", 4, 4)]),
    (abi.DLDevice, 8, 4, [("device_type", 0, 4), ("device_id", 4, 4)]),
    (abi.DLDataType, 4, 2, [("code", 0, 1), ("bits", 1, 1), ("lanes", 2, 2)]),
    (abi.DLTensor, 48, 8, [("data", 0, 8), ("device", 8, 8), ("ndim", 16, 4), ("dtype", 20, 4),
                           ("shape", 24, 8), ("strides", 32, 8), ("byte_offset", 40, 8)]),
    (abi.DLManagedTensor, 64, 8, [("dl_tensor", 0, 48), ("manager_ctx", 48, 8), ("deleter", 56, 8)]),
    (abi.DLManagedTensorVersioned, 80, 8, [("version", 0, 8), ("manager_ctx", 8, 8), ("deleter", 16, 8),
                                           ("flags", 24, 8), ("dl_tensor", 32, 48)]),
    (abi.DLPackExchangeAPIHeader, 16, 8, [("version", 0, 8), ("prev_api", 8, 8)]),
    (abi.DLPackExchangeAPI, 56, 8, [("header", 0, 16), ("managed_tensor_allocator", 16, 8),
                                    ("managed_tensor_from_py_object_no_sync", 24, 8),
                                    ("managed_tensor_to_py_object_no_sync", 32, 8),
                                    ("dltensor_from_py_object_no_sync", 40, 8),
                                    ("current_work_stream", 48, 8)]),
]


@pytest.mark.parametrize("cls,size,align,fields", LAYOUT, ids=[c[0].__name__ for c in LAYOUT])
def test_struct_layout(cls, size, align, fields):
    assert ctypes.sizeof(cls) == size
    assert ctypes.alignment(cls) == align
    assert [name for name, *_ in fields] == [f[0] for f in cls._fields_], "fields missing or out of order"
    for name, offset, fsize in fields:
        descriptor = getattr(cls, name)
        assert (descriptor.offset, descriptor.size) == (offset, fsize), f"{cls.__name__}.{name}"


def test_signedness_of_integer_fields():
    # int32 device fields and ndim can be negative on the wire; the rest are unsigned.
    d = abi.DLDevice(-1, -2)
    assert (d.device_type, d.device_id) == (-1, -2)
    t = abi.DLTensor()
    t.ndim = -3
    t.byte_offset = 2**64 - 1
    assert t.ndim == -3 and t.byte_offset == 2**64 - 1
    dt = abi.DLDataType(255, 255, 65535)
    assert (dt.code, dt.bits, dt.lanes) == (255, 255, 65535)
    v = abi.DLManagedTensorVersioned()
    v.flags = 2**64 - 1
    v.version.major = 2**32 - 1
    assert v.flags == 2**64 - 1 and v.version.major == 2**32 - 1


def test_fields_land_at_their_offsets_in_memory():
    # Write through ctypes, read the raw bytes back at the table's offsets.
    m = abi.DLManagedTensorVersioned()
    m.version.major, m.version.minor = 1, 3
    m.manager_ctx = 0x1122334455667788
    m.flags = 3
    m.dl_tensor.device.device_type, m.dl_tensor.device.device_id = 13, 7
    m.dl_tensor.ndim = 5
    m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits, m.dl_tensor.dtype.lanes = 4, 16, 1
    m.dl_tensor.byte_offset = 256
    raw = ctypes.string_at(ctypes.addressof(m), 80)
    assert struct.unpack_from("<II", raw, 0) == (1, 3)
    assert struct.unpack_from("<Q", raw, 8) == (0x1122334455667788,)
    assert struct.unpack_from("<Q", raw, 24) == (3,)
    assert struct.unpack_from("<ii", raw, 32 + 8) == (13, 7)
    assert struct.unpack_from("<i", raw, 32 + 16) == (5,)
    assert struct.unpack_from("<BBH", raw, 32 + 20) == (4, 16, 1)
    assert struct.unpack_from("<Q", raw, 32 + 40) == (256,)


def test_versions_and_flags():
    assert (abi.DLPACK_MAJOR_VERSION, abi.DLPACK_MINOR_VERSION) == (1, 3)
    assert (tx.DLPACK_MAJOR_VERSION, tx.DLPACK_MINOR_VERSION) == (1, 3)
    assert abi.DLPACK_FLAG_BITMASK_READ_ONLY == tx.DLPACK_FLAG_BITMASK_READ_ONLY == 1
    assert abi.DLPACK_FLAG_BITMASK_IS_COPIED == tx.DLPACK_FLAG_BITMASK_IS_COPIED == 2
    assert abi.DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED == 4


def test_capsule_names():
    assert abi.DLTENSOR_NAME == b"dltensor"
    assert abi.USED_DLTENSOR_NAME == b"used_dltensor"
    assert abi.DLTENSOR_VERSIONED_NAME == b"dltensor_versioned"
    assert abi.USED_DLTENSOR_VERSIONED_NAME == b"used_dltensor_versioned"


DEVICE_TYPES = {"kDLCPU": 1, "kDLCUDA": 2, "kDLCUDAHost": 3, "kDLOpenCL": 4, "kDLVulkan": 7, "kDLMetal": 8,
                "kDLVPI": 9, "kDLROCM": 10, "kDLROCMHost": 11, "kDLExtDev": 12, "kDLCUDAManaged": 13,
                "kDLOneAPI": 14, "kDLWebGPU": 15, "kDLHexagon": 16, "kDLMAIA": 17, "kDLTrn": 18}

DTYPE_CODES = {"kDLInt": 0, "kDLUInt": 1, "kDLFloat": 2, "kDLOpaqueHandle": 3, "kDLBfloat": 4, "kDLComplex": 5,
               "kDLBool": 6, "kDLFloat8_e3m4": 7, "kDLFloat8_e4m3": 8, "kDLFloat8_e4m3b11fnuz": 9,
               "kDLFloat8_e4m3fn": 10, "kDLFloat8_e4m3fnuz": 11, "kDLFloat8_e5m2": 12, "kDLFloat8_e5m2fnuz": 13,
               "kDLFloat8_e8m0fnu": 14, "kDLFloat6_e2m3fn": 15, "kDLFloat6_e3m2fn": 16, "kDLFloat4_e2m1fn": 17}


def test_device_type_numbers():
    assert {t.name: int(t) for t in abi.DLDeviceType} == DEVICE_TYPES
    assert tx.DeviceType is abi.DLDeviceType
    assert tx.DeviceType.kDLCPU == 1 and tx.DeviceType.kDLCUDA == 2 and tx.DeviceType.kDLCUDAManaged == 13


def test_dtype_code_numbers():
    assert {c.name: int(c) for c in abi.DLDataTypeCode} == DTYPE_CODES
