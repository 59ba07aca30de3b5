"""ctypes mirror of ``dlpack.h`` 1.3 (dmlc/dlpack tag v1.3): data only, no behaviour.

Spellings follow the header so a grep finds both sides. Sizes and offsets on 64-bit
Linux are checked by ``tests/cpu/test_abi.py`` against the table in DLPack's header:
``DLTensor`` 48 bytes, ``DLManagedTensor`` 64, ``DLManagedTensorVersioned`` 80.
"""

from __future__ import annotations

import ctypes
import enum

DLPACK_MAJOR_VERSION = 1
DLPACK_MINOR_VERSION = 3

DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1
DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED = 1 << 2

# Capsule names. CPython keeps the name *pointer*, so these bytes objects must live
# for the whole process: module globals do that.
DLTENSOR_NAME = b"dltensor"
USED_DLTENSOR_NAME = b"used_dltensor"
DLTENSOR_VERSIONED_NAME = b"dltensor_versioned"
USED_DLTENSOR_VERSIONED_NAME = b"used_dltensor_versioned"


class DLDeviceType(enum.IntEnum):
    """``DLDeviceType`` with the header's names and numbers (5 and 6 are unassigned)."""

    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16
    kDLMAIA = 17
    kDLTrn = 18


class DLDataTypeCode(enum.IntEnum):
    """``DLDataTypeCode``; in memory it sits in the ``uint8_t`` field ``DLDataType.code``."""

    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLOpaqueHandle = 3
    kDLBfloat = 4
    kDLComplex = 5
    kDLBool = 6
    kDLFloat8_e3m4 = 7
    kDLFloat8_e4m3 = 8
    kDLFloat8_e4m3b11fnuz = 9
    kDLFloat8_e4m3fn = 10
    kDLFloat8_e4m3fnuz = 11
    kDLFloat8_e5m2 = 12
    kDLFloat8_e5m2fnuz = 13
    kDLFloat8_e8m0fnu = 14
    kDLFloat6_e2m3fn = 15
    kDLFloat6_e3m2fn = 16
    kDLFloat4_e2m1fn = 17


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # in elements
        ("byte_offset", ctypes.c_uint64),  # in bytes
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensorDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensor*)
]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensorVersioned*)
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


class DLPackExchangeAPIHeader(ctypes.Structure):
    pass


DLPackExchangeAPIHeader._fields_ = [
    ("version", DLPackVersion),
    ("prev_api", ctypes.POINTER(DLPackExchangeAPIHeader)),
]


class DLPackExchangeAPI(ctypes.Structure):
    _fields_ = [
        ("header", DLPackExchangeAPIHeader),
        ("managed_tensor_allocator", ctypes.c_void_p),
        ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
        ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
        ("dltensor_from_py_object_no_sync", ctypes.c_void_p),
        ("current_work_stream", ctypes.c_void_p),
    ]

#: The most dimensions this library reads from a DLTensor; beyond it the struct is refused
#: rather than read. Defined with the layout check it belongs to (exchange/layout.py;
#: exchange/native/native.h has the same limit).
from .layout import MAX_NDIM  # noqa: E402
