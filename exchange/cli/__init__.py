"""The ``tensor-exchange`` command line: a small argparse dispatcher.

Each subcommand lives in its own module, imported only when that subcommand runs
(``tensor-exchange --help`` imports none of them). A subcommand module provides

* ``add_arguments(parser)``: adds its options to its ``argparse`` subparser, and
* ``main(args) -> int``: runs it with the parsed ``argparse.Namespace``; the return
  value is the process exit status.

Adding a subcommand is one line in :data:`COMMANDS`. An option a subcommand does not
know is reported with that subcommand's usage.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Sequence

__all__ = ["COMMANDS", "build_parser", "main", "write_report"]

#: Ray's logger for its token-authentication notice, which every ``ray.init`` prints (local
#: clusters start with token authentication on). Our commands start and join clusters for
#: their own runs only, so they leave the notice out; a user's own ``ray.init`` still shows it.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"

#: Subcommand name -> (module implementing it, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("exchange.cli.demo", "digits MLP through NumPy -> ONNX Runtime -> PyTorch -> JAX, every hop via exchange, checked for sharing"),
    "bench": ("exchange.cli.bench", "measure DLPack hops, sizes, threads, a chain hop and release latency against the peers (--quick, --json, --plot DIR)"),
    "doctor": ("exchange.cli.doctor", "devices and frameworks found, how each speaks DLPack, and a quick self-check"),
    "top": ("exchange.cli.top", "live terminal view of another process's registry (it serves with EXCHANGE_INSPECT=1); q quits"),
    "snapshot": ("exchange.cli.snapshot", "another process's registry once, as JSON (the data top shows; schema in docs/observability.md)"),
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
        p.set_defaults(_module=module, _parser=p)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def write_report(write: Any) -> None:
    """Run ``write()`` (it prints a subcommand's report to stdout), then flush stdout.
    When the reader has gone (``| head``), stdout is pointed at /dev/null (Python's
    documented way, so the flush at exit finds nowhere to fail) and nothing is raised: the
    subcommand's exit status stays its verdict, and stderr stays open for what follows."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (AttributeError, OSError, ValueError):  # stdout replaced by a non-file (tests)
            pass


def quiet_ray_banner() -> None:
    """Leave out Ray's token-authentication notice (:data:`RAY_AUTH_LOGGER`) in this
    process; its errors still show. Imports nothing of Ray."""
    logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tensor-exchange`` and ``python -m exchange``. ``argv``: the
    arguments (None: ``sys.argv[1:]``). Returns the exit status; an unknown option
    exits 2 with the usage of the subcommand it follows (``SystemExit``, argparse's way)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # after the subcommand: its usage; before it: the top-level one
        after = args.command is not None and argv.index(args.command) < argv.index(unknown[0])
        (args._parser if after else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    quiet_ray_banner()
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
