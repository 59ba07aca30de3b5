"""The package's layout as its users and its own modules see it: the backends install
as ``exchange.devices`` (no top-level ``devices``), the floors of the layout import
only downwards, and ``import exchange`` loads the core alone.

Module-level imports and imports inside functions both count: a lazy import is still a
dependency. ``if TYPE_CHECKING:`` blocks do not.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

#: Where the tests run from (subprocesses start there); the checkout, except in CI's wheel pass.
ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
#: The checkout whose sources are read: CI's wheel pass runs a copy of tests/ and names it
#: in EXCHANGE_SOURCE_ROOT (ci/cpu.sh).
SOURCE = pathlib.Path(os.environ.get("EXCHANGE_SOURCE_ROOT") or ROOT)
PACKAGE = SOURCE / "exchange"
BACKENDS = SOURCE / "devices"

#: The library's bottom layer: what the backends may import of it.
BOTTOM = {"exchange._dlpack_abi", "exchange.device", "exchange.dtypes", "exchange.errors", "exchange.layout"}

#: Import circles tolerated for now: none (the chain reaches the Ray executor through
#: ``exchange.chain.ChainExecutor``; the two demo programs share exchange/cli/demo_parts.py).
KNOWN_CYCLES: set[frozenset[str]] = set()


def _module_name(path: pathlib.Path) -> str:
    if path.is_relative_to(BACKENDS):
        parts = ("exchange", "devices") + path.relative_to(BACKENDS).with_suffix("").parts
    else:
        parts = path.relative_to(SOURCE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports (absolute names), anywhere but under TYPE_CHECKING."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:  # ``from . import capsule`` imports a submodule,
                    found.add(f"{target}.{alias.name}")  # ``from .x import f`` the module x
                found.add(target)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. A package's ``__init__`` counts only where its
    own names are imported (``import exchange as tx``), not where it is merely the parent
    of a submodule (``from .dtypes import DType``, ``from . import capsule``)."""
    files = [p for p in PACKAGE.rglob("*.py")] + [p for p in BACKENDS.rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        deps = {m for m in _imports(path) if m in modules and m != name}
        graph[name] = {m for m in deps if not (modules[m].name == "__init__.py"
                                               and any(d.startswith(m + ".") for d in deps))}
    return graph


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def test_nothing_imports_a_top_level_devices_package():
    offenders = []
    for path in list(PACKAGE.rglob("*.py")) + list(BACKENDS.rglob("*.py")) + list((SOURCE / "tests").rglob("*.py")) \
            + list((SOURCE / "ci").rglob("*.py")):
        for name in _imports(path) if path.is_relative_to(PACKAGE) or path.is_relative_to(BACKENDS) else \
                _imports_outside(path):
            if name == "devices" or name.startswith("devices."):
                offenders.append(f"{path.relative_to(SOURCE)}: {name}")
    assert not offenders, offenders


def _imports_outside(path: pathlib.Path) -> set[str]:
    # tests/ and ci/ are not packages: only absolute imports matter there
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_the_backends_import_only_the_bottom_layer_of_the_library():
    graph = _graph()
    wrong = {name: sorted(m for m in deps if not m.startswith("exchange.devices") and m not in BOTTOM)
             for name, deps in graph.items() if name.startswith("exchange.devices")}
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, f"backends reaching above the bottom layer ({sorted(BOTTOM)}): {wrong}"


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert cycles <= KNOWN_CYCLES, f"import circles: {[sorted(c) for c in cycles - KNOWN_CYCLES]}"


def test_the_graph_sees_a_lazy_import():
    # the check above would pass vacuously if function-level imports were missed
    graph = _graph()
    assert "exchange.devices.base" in graph["exchange.tensor"]  # imported inside _backend()
    assert "exchange.layout" in graph["exchange.devices.cuda"]


# -- what ``import exchange`` loads ------------------------------------------------------------------
#: Modules ``import exchange`` must not load: the cross-process machinery, Ray, the CLI, chaining and
#: the framework adapters, the optional extras (metrics: prometheus_client; the bench's plots:
#: matplotlib), and the standard modules only they need.
NOT_AT_IMPORT = ["importlib.metadata", "socket", "secrets", "hmac", "selectors", "json", "multiprocessing",
                 "multiprocessing.reduction", "exchange.sharing", "exchange.chain", "exchange.frameworks",
                 "exchange.ray", "exchange.ray.objects", "exchange.ray.executor", "exchange.ray.transport",
                 "exchange.cli",
                 "exchange.devices", "exchange.devices.cpu", "ray", "torch", "jax", "cupy",
                 "exchange.metrics", "prometheus_client", "matplotlib"]

LIGHT = r"""
import sys
import numpy
before = set(sys.modules)
import exchange as tx
loaded = set(sys.modules) - before
print("LOADED:" + ",".join(sorted(m for m in NOT_AT_IMPORT if m in loaded)))
"""


def _run(code: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], cwd=kw.pop("cwd", ROOT), capture_output=True, text=True,
                          timeout=kw.pop("timeout", 120), env=env, **kw)


def test_import_exchange_loads_the_core_alone():
    proc = _run(f"NOT_AT_IMPORT = {NOT_AT_IMPORT!r}\n" + LIGHT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED:")][-1]
    assert line == "LOADED:", f"import exchange loaded: {line[7:]}"


LAZY_NAMES = r"""
import exchange as tx
from exchange.chain import Chain as C
from exchange.sharing import share as s, attach as a, ShareHandle as H
assert tx.Chain is C and tx.share is s and tx.attach is a and tx.ShareHandle is H
import exchange.sharing
assert callable(tx.share) and tx.share is s, tx.share  # the submodule never shadows the function
from exchange.devices.base import Stream, Event
assert tx.Stream is Stream and tx.Event is Event
assert {"Chain", "share", "attach", "RayExecutor"} <= set(dir(tx))
print("OK")
"""


def test_lazy_names_are_the_real_objects_and_never_shadowed():
    proc = _run(LAZY_NAMES)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


RAY_PACKAGE = r"""
import sys
import exchange as tx
import exchange.ray
from exchange.ray import executor, objects
from exchange.ray.executor import RayExecutor, InActor
assert RayExecutor is tx.RayExecutor and RayExecutor.__module__ == "exchange.ray.executor"
assert objects.SETUP_HOOK == "exchange.ray.objects.setup_worker"
assert "ray" not in sys.modules, "the exchange.ray package imported Ray"
print("OK")
"""


def test_the_ray_package_imports_no_ray_until_used():
    # Ray pickles tx.Tensor by these module paths, and importing Ray costs seconds
    proc = _run(RAY_PACKAGE)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


QUEUE_WITH_NO_CALL = r"""
import sys
import numpy as np
import exchange as tx           # first: multiprocessing is imported after it
import multiprocessing as mp

def child(q, out):
    t = q.get(timeout=60)
    out.put(float(np.from_dlpack(t).sum()))
    del t

if __name__ == "__main__":
    assert "exchange.sharing" not in sys.modules
    ctx = mp.get_context(sys.argv[1])
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, out))
    p.start()
    t = tx.from_dlpack(np.arange(10.0))   # private memory: the reducer shares a copy
    q.put(t)
    print("SUM", out.get(timeout=60))
    p.join(60)
    print("EXIT", p.exitcode)
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_queue_carries_a_tensor_with_no_call_first(tmp_path, method):
    script = tmp_path / "queue_no_call.py"
    script.write_text(QUEUE_WITH_NO_CALL)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", str(script), method], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SUM 45.0" in proc.stdout and "EXIT 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_version_agrees_with_the_metadata_and_the_command_line():
    from importlib.metadata import version

    import exchange

    assert exchange.__version__ == version("tensor-exchange")
    proc = subprocess.run([sys.executable, "-m", "exchange", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert exchange.__version__ in proc.stdout


BARE_CHECKOUT = r"""
import sys
import exchange, exchange.devices.cpu as cpu, exchange.devices.base as base
from exchange.devices.base import get_backend
assert cpu.__file__.startswith(sys.argv[1]), cpu.__file__
assert "devices" not in sys.modules and "devices.cpu" not in sys.modules
print(type(get_backend(exchange.DeviceType.kDLCPU)).__name__)
"""


def test_a_bare_checkout_on_pythonpath_finds_the_backends(tmp_path):
    # how ci/gpu-check.sh runs on a GPU machine: no install, the checkout on PYTHONPATH, run from elsewhere;
    # -S keeps site-packages (and an editable install's finder) out of it
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SOURCE)
    numpy_dir = str(pathlib.Path(__import__("numpy").__file__).parent.parent)
    code = f"import sys; sys.path.append({numpy_dir!r})\n" + BARE_CHECKOUT
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(BACKENDS)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "CPUBackend"
