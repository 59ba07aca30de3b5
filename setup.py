"""Builds the optional compiled helper exchange._native (capsule destructor, deleters,
capsule construction). It is optional: where no compiler is at hand the package
installs without it and exchange/_capsule_ctypes.py does the same work in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("exchange._native", ["exchange/_native.c"], optional=True)])
