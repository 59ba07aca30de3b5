"""The version, read by pyproject.toml (``[tool.setuptools.dynamic]``) and by
``exchange.__version__``: one place, and no ``importlib.metadata`` at import time."""

__version__ = "0.1.0"
