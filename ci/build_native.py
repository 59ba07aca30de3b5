"""Build the compiled core ``exchange._native`` in place, in a checkout run from
PYTHONPATH (ci/gpu-check.sh's build step), and check that it loads.

    python ci/build_native.py [--gcc] [--root DIR]

With setuptools 77 or later: ``setup.py build_ext --inplace``. With an older setuptools
(68 to 76 refuse this pyproject: "project.license must be valid exactly by one
definition") or none, or with ``--gcc``: the C compiler over ``exchange/native/*.c``
with Python's own flags from ``sysconfig`` (CFLAGS, CCSHARED, LDSHARED's options), then
with a minimal ``-O2 -fPIC -shared`` if those fail (a Python built with another
compiler may name flags gcc lacks). The compiler is ``$CC``, else gcc, else cc.

Exit status: 0 built and loaded (a fresh process imports ``exchange._native`` from
this checkout: ``exchange._core.compiled()`` is True); 1 expected but not loaded (a
compiler and Python.h are here, yet the build failed or gave nothing importable: the
GPU check fails then); 3 not expected (no C compiler, or no Python.h: the pure-Python
path only). The last line says which, and why.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SETUPTOOLS_MIN = (77,)


def _setuptools_ok() -> tuple[bool, str]:
    try:
        import setuptools
    except ImportError:
        return False, "setuptools is not installed"
    parts = []
    for piece in setuptools.__version__.split(".")[:1]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < SETUPTOOLS_MIN:
        return False, f"setuptools {setuptools.__version__} is older than 77 (it refuses this pyproject's license)"
    return True, f"setuptools {setuptools.__version__}"


def compiler() -> str | None:
    """The C compiler to use: $CC's first word, else gcc, else cc (None: none)."""
    cc = os.environ.get("CC", "").split()
    for name in (cc[0] if cc else None, "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def python_flags() -> list[str]:
    """Python's own compile and link flags for an extension (sysconfig)."""
    flags = []
    for var in ("CFLAGS", "CCSHARED"):
        flags += shlex.split(sysconfig.get_config_var(var) or "")
    ldshared = shlex.split(sysconfig.get_config_var("LDSHARED") or "")
    flags += [f for f in ldshared[1:] if f.startswith("-")] or ["-shared"]
    if "-shared" not in flags:
        flags.append("-shared")
    return flags


def loads(root: Path) -> tuple[bool, str]:
    """Does a fresh process import the compiled core from ``root``?"""
    env = {k: v for k, v in os.environ.items() if k != "EXCHANGE_PURE_PYTHON"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    code = ("import exchange._core as i, os; print(i.compiled(), os.path.dirname(i.impl.__file__)"
            " if i.compiled() else i.WHY_PURE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=120)
    text = (out.stdout.strip() or out.stderr.strip()[-500:])
    ok = out.returncode == 0 and text.startswith("True ") and Path(text[5:]).resolve() == (root / "exchange").resolve()
    return ok, text


def build_with_compiler(root: Path, cc: str, include: str) -> tuple[bool, str]:
    target = root / "exchange" / f"_native{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    sources = sorted(glob.glob(str(root / "exchange" / "native" / "*.c")))
    last = ""
    for kind, flags in (("Python's", python_flags()), ("minimal", ["-O2", "-fPIC", "-shared", "-DNDEBUG"])):
        cmd = [cc, *flags, f"-I{include}", *sources, "-o", str(target)]
        print("build:", " ".join(shlex.quote(c) for c in cmd), flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            # a failed setup.py build before this one left its note (setup.py's NOT_BUILT_NOTE)
            (root / "exchange" / "_native_not_built.json").unlink(missing_ok=True)
            return True, f"{Path(cc).name} with {kind} flags"
        last = (out.stderr.strip() or out.stdout.strip())[-800:]
        print(f"build: {Path(cc).name} failed:\n{last}", flush=True)
    return False, f"{Path(cc).name} failed: {last.splitlines()[-1] if last else '?'}"


def build_with_setuptools(root: Path) -> tuple[bool, str]:
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    print("build:", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)
    text = (out.stderr.strip() or out.stdout.strip())[-800:]
    if out.returncode != 0:
        print(f"build: setup.py failed:\n{text}", flush=True)
        return False, "setup.py build_ext failed"
    return True, "setup.py build_ext"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gcc", action="store_true", help="use the C compiler directly, even with a usable setuptools")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout (default: this script's)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    cc = compiler()
    include = sysconfig.get_paths()["include"]
    if cc is None:
        print("compiled core: not expected: no C compiler ($CC, gcc, cc); the pure-Python path only")
        return 3
    if not (Path(include) / "Python.h").is_file():
        print(f"compiled core: not expected: no Python.h in {include} (the python3-dev headers are missing); "
              "the pure-Python path only")
        return 3
    for old in glob.glob(str(root / "exchange" / "_native*.so")):
        os.remove(old)  # a stale build must not pass for this one
    tried = []
    use_setuptools, why = (False, "--gcc given") if args.gcc else _setuptools_ok()
    if use_setuptools:
        ok, how = build_with_setuptools(root)
        tried.append(how)
        if ok:
            loaded, text = loads(root)
            if loaded:
                print(f"compiled core: built ({how}) and loaded")
                return 0
            tried.append(f"it did not load ({text})")
    else:
        tried.append(f"not setup.py: {why}")
    ok, how = build_with_compiler(root, cc, include)
    tried.append(how)
    if ok:
        loaded, text = loads(root)
        if loaded:
            print(f"compiled core: built ({how}) and loaded")
            return 0
        tried.append(f"it did not load ({text})")
    print(f"compiled core: EXPECTED BUT NOT LOADED (a compiler and Python.h are here): {'; '.join(tried)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
