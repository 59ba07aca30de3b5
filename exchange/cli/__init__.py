"""The ``tensor-exchange`` command line: a small argparse dispatcher.

Each subcommand lives in its own module, imported only when that subcommand runs
(``tensor-exchange --help`` imports none of them). A subcommand module provides

* ``add_arguments(parser)``: adds its options to its ``argparse`` subparser, and
* ``main(args) -> int``: runs it with the parsed ``argparse.Namespace``; the return
  value is the process exit status.

Adding a subcommand is one line in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand name -> (module implementing it, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("exchange.cli.demo", "digits MLP through NumPy -> ONNX Runtime -> PyTorch -> JAX, every hop via exchange, checked for sharing"),
    "bench": ("exchange.cli.bench", "measure DLPack hops, sizes, threads, a chain hop and release latency against the peers (--quick, --json)"),
    "doctor": ("exchange.cli.doctor", "devices and frameworks found, how each speaks DLPack, and a quick self-check"),
}


def _version() -> str:
    from .._version import __version__

    return __version__


def _selected(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first argument that is one), if any."""
    for arg in argv:
        if arg in COMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for ``argv``: every subcommand is listed, but only the one named in
    ``argv`` has its module imported to add its options."""
    parser = argparse.ArgumentParser(
        prog="tensor-exchange",
        description="Zero-copy, stream-aware tensor exchange between frameworks over DLPack.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _selected(argv)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tensor-exchange`` and ``python -m exchange``. ``argv``: the
    arguments (None: ``sys.argv[1:]``). Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
