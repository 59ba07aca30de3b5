"""Builds the optional compiled core exchange._native (exchange/native/*.c: capsules and
our deleters, registry records, Tensor storage, the import and export hot paths, the
DLPack C exchange API). It is optional: where no compiler is at hand the package
installs without it and the pure-Python twins (exchange/_capsule_ctypes.py, the Python
classes of exchange/registry.py and exchange/tensor.py) do the same work."""

from setuptools import Extension, setup

SOURCES = ["exchange/native/module.c", "exchange/native/capsule.c", "exchange/native/registry.c",
           "exchange/native/tensor.c"]

setup(ext_modules=[Extension("exchange._native", SOURCES, depends=["exchange/native/native.h"], optional=True)])
