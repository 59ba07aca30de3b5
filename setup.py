"""Builds the optional compiled core exchange._native (exchange/native/*.c: capsules and
our deleters, registry records, Tensor storage, the import and export hot paths, the
DLPack C exchange API, host copies and the host streams' work queues). It is optional:
where no compiler is at hand the package installs without it and its pure-Python twin
(exchange/_core/_pure/, behind the same API: exchange/_core/) does the same work.

A build that could not compile the core says so, and keeps the reason:

* ``exchange/_native_not_built.json`` (NOT_BUILT_NOTE), beside where the core would have
  gone (in the wheel, or in the tree for ``build_ext --inplace``): the reason and the
  fix, which exchange/_core/choice.py reads to warn once at first use and ``tensor-exchange
  doctor`` reports. A build that compiles the core removes a stale one.
* A notice on stderr (``pip install -v``, ``python -m build``) and on the terminal the
  build runs in, if any (``/dev/tty``): pip shows a successful build's output only with
  ``-v``, so the terminal is where a plain ``pip install`` user sees it.
"""

import json
import os
import shutil
import sys
import sysconfig
import textwrap

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = ["exchange/native/module.c", "exchange/native/capsule.c", "exchange/native/registry.c",
           "exchange/native/tensor.c", "exchange/native/copy.c", "exchange/native/hostqueue.c",
           "exchange/native/stagetask.c"]
#: Written beside the core's place when it could not be built (exchange/_core/choice.py reads it).
NOT_BUILT_NOTE = "_native_not_built.json"
REINSTALL = ("then reinstall without pip's cached build of it: pip install --force-reinstall --no-deps "
             "--no-cache-dir tensor-exchange (or the sdist's path)")


class BuildExt(build_ext):
    """build_ext that records why the optional core could not be built, and says so."""

    def run(self):
        super().run()
        if not self.inplace:
            return
        # --inplace and editable installs build in build_lib, then copy the core into the
        # tree: the note (or its absence) follows it there
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            package = ext.name.rpartition(".")[0]
            built = os.path.join(self.build_lib, *package.split("."), NOT_BUILT_NOTE)
            in_tree = os.path.join(build_py.get_package_dir(package), NOT_BUILT_NOTE)
            if os.path.exists(built):
                shutil.copyfile(built, in_tree)
            elif os.path.exists(in_tree):
                os.remove(in_tree)

    def build_extension(self, ext):
        note = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), NOT_BUILT_NOTE)
        try:
            super().build_extension(ext)
        except Exception as exc:  # setuptools lets the optional core's failure pass: record why first
            reason, fix = self._why_not_built(exc)
            os.makedirs(os.path.dirname(note), exist_ok=True)
            with open(note, "w") as f:
                json.dump({"reason": reason, "fix": fix, "python": sys.version.split()[0]}, f)
            _notice(reason, fix)
            raise
        if os.path.exists(note):
            os.remove(note)

    def _why_not_built(self, exc):
        compiler = (getattr(self.compiler, "compiler_so", None) or ["cc"])[0]
        if shutil.which(compiler) is None:
            return (f"no C compiler: {compiler!r} (the compiler this Python names, or $CC) is not on PATH",
                    f"install one (Debian/Ubuntu: apt install gcc python3-dev; Fedora: dnf install gcc "
                    f"python3-devel), {REINSTALL}")
        include = sysconfig.get_paths()["include"]
        if not os.path.isfile(os.path.join(include, "Python.h")):
            version = "%d.%d" % sys.version_info[:2]
            return (f"Python's C headers are missing (no Python.h in {include})",
                    f"install them (Debian/Ubuntu: apt install python{version}-dev; Fedora: dnf install "
                    f"python3-devel), {REINSTALL}")
        return (f"the C compiler failed ({exc})",
                f"pip install -v shows the compiler's errors: please report them to tensor-exchange; {REINSTALL} "
                "once fixed")


def _notice(reason, fix):
    """The notice, on stderr and on the build's terminal (where pip's user looks)."""
    bar = "*" * 88
    body = (f"tensor-exchange: the compiled core exchange._native was NOT built: {reason}. The package works "
            "without it, on its pure-Python path, where an import hop costs about 50x NumPy's own (about 1.4x "
            f"with the core). To get the core: {fix}.")
    text = f"\n{bar}\n{textwrap.fill(body, 88, break_on_hyphens=False, break_long_words=False)}\n{bar}\n"
    sys.stderr.write(text)
    try:
        with open("/dev/tty", "w") as tty:  # no terminal (CI, a container build): ENXIO, nothing to do
            tty.write(text)
    except OSError:
        pass


setup(ext_modules=[Extension("exchange._native", SOURCES, depends=["exchange/native/native.h"], optional=True)],
      cmdclass={"build_ext": BuildExt})
