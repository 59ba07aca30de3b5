"""Element types in DLPack's terms (``DLDataType``: code, bits, lanes) and their NumPy twins.

Every DLPack dtype that NumPy or ml_dtypes can hold is known: bool, int and uint 8 to
64, float16/32/64, bfloat16, complex64/128 and the float8 kinds of ml_dtypes. bfloat16
and float8 need the optional ``ml_dtypes`` package only when a NumPy view is asked for.
Packed sub-byte types (float6, float4) are refused: NumPy cannot hold them packed.
"""

from __future__ import annotations

from typing import Any

from ._dlpack_abi import DLDataTypeCode as C

__all__ = ["DType", "dtype"]


class DType:
    """One element type: ``name`` (``"float32"``), DLPack ``code``, ``bits`` and ``lanes``
    (always 1 here), and ``itemsize`` in bytes; ``numpy`` (also ``dtype``, which NumPy
    reads: ``np.dtype(t.dtype)`` works) the NumPy dtype. Compare with ``==`` against a
    DType, its name, or anything :func:`dtype` takes (a NumPy, PyTorch or JAX dtype)."""

    __slots__ = ("name", "code", "bits", "lanes", "itemsize", "_np_source")

    def __init__(self, name: str, code: int, bits: int, np_source: str) -> None:
        self.name = name
        self.code = int(code)
        self.bits = bits
        self.lanes = 1
        self.itemsize = bits // 8
        self._np_source = np_source  # "numpy:<name>" or "ml_dtypes:<attr>"

    @property
    def numpy(self) -> Any:
        """The matching ``numpy.dtype``. Raises TypeError when it needs ml_dtypes and
        ml_dtypes is not installed, or is older than 0.5 and lacks this type (float8_e3m4,
        float8_e4m3, float8_e8m0fnu)."""
        import numpy as np

        lib, _, attr = self._np_source.partition(":")
        if lib == "numpy":
            return np.dtype(attr)
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"dtype {self.name} needs the ml_dtypes package for a NumPy view; pip install ml_dtypes"
            ) from None
        scalar_type = getattr(ml_dtypes, attr, None)
        if scalar_type is None:
            version = getattr(ml_dtypes, "__version__", "an older one")
            raise TypeError(f"dtype {self.name} needs ml_dtypes 0.5 or later ({version} is installed); "
                            "pip install -U ml_dtypes")
        return np.dtype(scalar_type)

    @property
    def dtype(self) -> Any:
        """The same as :attr:`numpy`: the attribute NumPy reads from an object it is asked
        to take as a dtype, so ``np.dtype(t.dtype)``, ``np.zeros(3, t.dtype)`` and
        ``np.finfo(t.dtype)`` take a tx.DType. TypeError as :attr:`numpy`."""
        return self.numpy

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self.code == other.code and self.bits == other.bits
        try:
            return dtype(other) is self  # type: ignore[arg-type]
        except Exception:  # not a dtype, or one whose own code raises: unequal, never an error
            return False

    def __hash__(self) -> int:
        return hash((self.code, self.bits))

    def __repr__(self) -> str:
        return f"tx.DType('{self.name}')"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self):
        return (dtype, (self.name,))


_TABLE = [
    ("bool", C.kDLBool, 8, "numpy:bool"),
    ("int8", C.kDLInt, 8, "numpy:int8"),
    ("int16", C.kDLInt, 16, "numpy:int16"),
    ("int32", C.kDLInt, 32, "numpy:int32"),
    ("int64", C.kDLInt, 64, "numpy:int64"),
    ("uint8", C.kDLUInt, 8, "numpy:uint8"),
    ("uint16", C.kDLUInt, 16, "numpy:uint16"),
    ("uint32", C.kDLUInt, 32, "numpy:uint32"),
    ("uint64", C.kDLUInt, 64, "numpy:uint64"),
    ("float16", C.kDLFloat, 16, "numpy:float16"),
    ("float32", C.kDLFloat, 32, "numpy:float32"),
    ("float64", C.kDLFloat, 64, "numpy:float64"),
    ("bfloat16", C.kDLBfloat, 16, "ml_dtypes:bfloat16"),
    ("complex64", C.kDLComplex, 64, "numpy:complex64"),
    ("complex128", C.kDLComplex, 128, "numpy:complex128"),
    ("float8_e3m4", C.kDLFloat8_e3m4, 8, "ml_dtypes:float8_e3m4"),
    ("float8_e4m3", C.kDLFloat8_e4m3, 8, "ml_dtypes:float8_e4m3"),
    ("float8_e4m3b11fnuz", C.kDLFloat8_e4m3b11fnuz, 8, "ml_dtypes:float8_e4m3b11fnuz"),
    ("float8_e4m3fn", C.kDLFloat8_e4m3fn, 8, "ml_dtypes:float8_e4m3fn"),
    ("float8_e4m3fnuz", C.kDLFloat8_e4m3fnuz, 8, "ml_dtypes:float8_e4m3fnuz"),
    ("float8_e5m2", C.kDLFloat8_e5m2, 8, "ml_dtypes:float8_e5m2"),
    ("float8_e5m2fnuz", C.kDLFloat8_e5m2fnuz, 8, "ml_dtypes:float8_e5m2fnuz"),
    ("float8_e8m0fnu", C.kDLFloat8_e8m0fnu, 8, "ml_dtypes:float8_e8m0fnu"),
]

_BY_NAME: dict[str, DType] = {}
_BY_CODE: dict[tuple[int, int], DType] = {}
for _name, _code, _bits, _src in _TABLE:
    _dt = DType(_name, _code, _bits, _src)
    _BY_NAME[_name] = _dt
    _BY_CODE[(int(_code), _bits)] = _dt
ALL: tuple[DType, ...] = tuple(_BY_NAME.values())


def dtype(spec: "DType | str | Any") -> DType:
    """The DType for a name (``"float32"``), a DType, a NumPy dtype or scalar type, a
    NumPy spelling (``np.float32``, ``"f4"``), or another framework's dtype object:
    PyTorch's (``torch.float16``), JAX's (``jnp.bfloat16``, ml_dtypes' scalar types), and
    any whose ``str()`` or ``.name`` is one of the names, alone or after its module's
    name (``"paddle.float32"``, ``"mlx.core.int8"``; TensorFlow's ``.name``). No framework
    is imported to tell: the object's own type and text say it.

    Raises TypeError for something that is not a dtype (an unknown name lists the valid
    ones, and the closest; None too, which NumPy reads as float64: leave ``dtype`` out
    for a function's default), ValueError for a dtype DLPack cannot carry here
    (structured, non-native byte order, object, string, or another framework's dtype
    with no equivalent here, such as ``torch.complex32``).
    """
    if isinstance(spec, DType):
        return spec
    if spec is None:
        raise TypeError(_not_a_dtype(spec))
    if isinstance(spec, str):
        spec = str.__str__(spec)  # its text: a subclass's __eq__ or __hash__ must not choose the entry
        found = _BY_NAME.get(spec)
        if found is not None:
            return found
    else:
        found = _foreign(spec)
        if found is not None:
            return found
    import numpy as np

    try:
        npdt = np.dtype(spec)
    except (TypeError, ValueError):  # ValueError: an array (np.dtype reads its .dtype and gives up)
        raise TypeError(_not_a_dtype(spec)) from None
    except Exception as exc:  # the object's own code raised (a .dtype or __repr__ NumPy called)
        raise TypeError(_not_a_dtype(spec)) from exc
    if not npdt.isnative:
        import sys

        order = {">": "big", "<": "little"}.get(npdt.byteorder, "another")
        # named as in native order: str() of a swapped ml_dtypes type says only ">V2"
        raise ValueError(f"dtype {npdt.newbyteorder('=').name} in {order}-endian byte order: DLPack carries "
                         f"native values only ({sys.byteorder}-endian here); convert an array first: "
                         "a.astype(a.dtype.newbyteorder('='))")
    found = _BY_NAME.get(npdt.name)
    if found is None or found.name != npdt.name:
        raise ValueError(
            f"dtype {npdt!r} has no DLPack equivalent here; supported: {', '.join(_BY_NAME)}"
        )
    return found


def _foreign(spec: Any) -> DType | None:
    """The DType of another framework's dtype object, read from its text: ``str(spec)``
    or ``spec.name`` being a name of ours, alone or after a prefix of the object's own
    module path (``torch.float32`` is a ``torch.dtype``). None when neither reads so
    (NumPy's spellings are then tried); ValueError when the text is such a dtype's but
    names one with no equivalent here (``torch.complex32``)."""
    module = getattr(type(spec), "__module__", None) or ""
    if module in ("builtins", "numpy") or module.startswith(("numpy.", "ml_dtypes")):
        return None  # NumPy's own spellings: np.dtype reads them
    unknown = None
    for text in (_text(spec, str), _text(spec, lambda s: s.name)):
        if text is None:
            continue
        prefix, _, name = text.rpartition(".")
        if prefix and not (module == prefix or module.startswith(prefix + ".")):
            continue  # "a.b" from an object not of module a: not a dtype's own name
        found = _BY_NAME.get(name)
        if found is not None:
            return found
        if prefix and name.isidentifier():
            unknown = text
    if unknown is not None:
        raise ValueError(f"dtype {unknown} has no DLPack equivalent here; supported: {', '.join(_BY_NAME)}")
    return None


def _text(spec: Any, read: Any) -> str | None:
    try:
        text = read(spec)
    except Exception:
        return None
    if not isinstance(text, str):
        return None
    text = str.__str__(text)  # a plain str: a subclass's own methods would run in the reading below
    return text if len(text) <= 64 else None


def _not_a_dtype(spec: Any) -> str:
    if isinstance(spec, str):
        import difflib

        # no name of ours is longer than 18 characters: a long text is close to none
        close = difflib.get_close_matches(spec.lower(), list(_BY_NAME), n=1) if len(spec) <= 40 else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (f"unknown dtype {_shown(spec)}{hint}; valid names: {', '.join(_BY_NAME)} "
                "(or a NumPy spelling such as 'f4')")
    if spec is None:
        return ("not a dtype: None (NumPy reads it as float64; tx does not guess); leave dtype out for the default, "
                "or pass a name such as 'float32', a tx.DType, or a NumPy, PyTorch or JAX dtype")
    return (f"not a dtype: {_shown(spec)} ({type(spec).__module__}.{type(spec).__qualname__}); pass a name such as "
            "'float32', a tx.DType, or a NumPy, PyTorch or JAX dtype")


def _shown(spec: Any) -> str:
    """``repr(spec)`` for a message: at most 80 characters, and never an exception (the
    object's own __repr__ may raise)."""
    try:
        text = repr(spec)
    except Exception:
        return f"<{type(spec).__qualname__} object whose repr() raised>"
    return text if len(text) <= 80 else text[:60] + "..." + text[-17:]


def from_dlpack_code(code: int, bits: int, lanes: int) -> DType:
    """The DType for a DLPack ``(code, bits, lanes)`` triple; BufferError for one this
    library cannot hold (unknown code, sub-byte or odd width, lanes != 1)."""
    if lanes != 1:
        raise BufferError(f"DLPack dtype with lanes={lanes} (a vector element type) is not supported; lanes must be 1")
    found = _BY_CODE.get((code, bits))
    if found is None:
        try:
            cname = C(code).name
        except ValueError:
            cname = "unknown code"
        raise BufferError(
            f"DLPack dtype (code={code} [{cname}], bits={bits}) is not supported; "
            "supported are bool, int/uint 8-64, float16/32/64, bfloat16, complex64/128 and 8-bit floats"
        )
    return found
