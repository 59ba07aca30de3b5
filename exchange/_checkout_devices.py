"""``exchange.devices`` in a source checkout run from ``PYTHONPATH`` (how ci/gpu-check.sh
runs on a bare GPU machine).

The backends live in the repository's top-level ``devices/`` folder (the project's
layout) and install as the subpackage ``exchange.devices`` (pyproject.toml's
``package-dir``; a wheel holds them at ``exchange/devices/``). A checkout on
``PYTHONPATH`` has no ``exchange/devices/``: this finder, placed by
``exchange/__init__.py`` only in that case, maps the one name
``exchange.devices`` to ``devices/`` beside the package that was imported (first on
``sys.meta_path``, so an editable install's finder pointing at another checkout cannot
win over it). Its submodules are then found
through the package's ``__path__`` as usual. Nothing else is ever imported as
``devices``: no top-level package of that name exists at run time.
"""

from __future__ import annotations

import importlib.util
import os
import sys

NAME = "exchange.devices"


class _SourceTreeBackends:
    """A meta path finder for ``exchange.devices`` alone (PEP 451 ``find_spec``)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(self.folder, "__init__.py"), submodule_search_locations=[self.folder])


def install(package_dir: str) -> None:
    """Map ``exchange.devices`` to ``<checkout>/devices`` when ``package_dir`` (the
    folder of ``exchange/__init__.py``) has no ``devices`` subpackage of its own."""
    if os.path.isdir(os.path.join(package_dir, "devices")):
        return  # installed from a wheel or an sdist: the subpackage is there
    folder = os.path.join(os.path.dirname(package_dir), "devices")
    if os.path.isfile(os.path.join(folder, "__init__.py")) and not any(
            isinstance(f, _SourceTreeBackends) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeBackends(folder))
