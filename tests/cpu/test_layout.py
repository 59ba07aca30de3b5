"""The package's layout as its users and its own modules see it: the backends install
as ``exchange.devices`` (no top-level ``devices``), the floors of the layout import
only downwards, ``import exchange`` loads the core alone, and the device-neutral
modules name no CUDA.

Module-level imports and imports inside functions both count: a lazy import is still a
dependency. ``if TYPE_CHECKING:`` blocks do not.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
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

#: The library's bottom layer: what the backends may import of it. ``exchange.channels.memfd``
#: is host shared memory (the standard library alone): the CPU backend allocates shared
#: memory from its arenas. ``exchange.runtime`` holds the fork and exit hooks they register.
#: ``exchange._core`` is the core seam's face, which imports nothing but this layer (its
#: hooks come through ``wire``): the CPU backend's host streams run on its ``HostQueue``.
BOTTOM = {"exchange._dlpack_abi", "exchange.device", "exchange.dtypes", "exchange.errors", "exchange.layout",
          "exchange.runtime", "exchange.channels.memfd", "exchange._core"}

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


def _imports(path: pathlib.Path, name: str = "") -> set[str]:
    """Every module ``path`` (module ``name``: by default its place in the checkout)
    imports (absolute names), anywhere but under TYPE_CHECKING."""
    name = name or _module_name(path)
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


def test_the_runtime_imports_only_the_bottom_layer():
    # the backends register their hooks there: it must stay as light as they are
    deps = _graph()["exchange.runtime"]
    assert deps <= BOTTOM, f"exchange.runtime imports {sorted(deps - BOTTOM)}"


# -- one fork-hook registration site -------------------------------------------------------------
#: The calls that hand a hook to the interpreter: only exchange/runtime.py makes them; the
#: rest of the library registers with it (its order is the runtime's, not the import order).
HOOK_CALLS = {"register_at_fork", "_register_atexit"}


def _hook_calls(path: pathlib.Path) -> int:
    found = 0
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            found += name in HOOK_CALLS
    return found


def test_one_fork_hook_registration_site():
    calls = {}
    for path in list(PACKAGE.rglob("*.py")) + list(BACKENDS.rglob("*.py")):
        n = _hook_calls(path)
        if n:
            calls[path.relative_to(SOURCE).as_posix()] = n
    runtime = calls.pop("exchange/runtime.py", 0)
    assert runtime == 2, f"exchange/runtime.py registers its fork hook and its exit hook once each, found {runtime}"
    assert not calls, f"fork or exit hooks registered outside exchange/runtime.py: {calls}"


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert cycles <= KNOWN_CYCLES, f"import circles: {[sorted(c) for c in cycles - KNOWN_CYCLES]}"


def test_the_graph_sees_a_lazy_import():
    # the check above would pass vacuously if function-level imports were missed
    graph = _graph()
    assert "exchange.devices.base" in graph["exchange.allocation"]  # imported inside _backend()
    assert "exchange.layout" in graph["exchange.devices.cuda"]


# -- the core seam -----------------------------------------------------------------------------------
#: The core seam (docs/design.md, "Modules"): it alone chooses between the compiled core
#: and its pure-Python twin; tools and tests ask ``exchange._core.compiled()`` too.
SEAM = "exchange._core"
#: What the seam shares with every other module: its API (``exchange._core``) and the
#: rules both paths share in Python (``exchange._core.rules``).
SEAM_FACE = {"exchange._core", "exchange._core.rules"}
#: Modules that read the choice itself, each with why (reporting goes through
#: ``exchange._core.compiled()``, which any module may call).
READS_THE_CHOICE: dict[str, str] = {}


def _path_reads(path: pathlib.Path, name: str = "") -> list[str]:
    """Where ``path`` (module ``name``) reads which path the core runs other than through
    ``compiled()``: an import of the C module, the old chooser or the seam's insides,
    or a read of ``NATIVE`` or ``<seam>.impl``."""
    name = name or _module_name(path)
    found = []
    for module in sorted(_imports(path, name)):
        inside_seam = module.startswith(SEAM + ".") and module.rpartition(".")[0] != SEAM \
            or module.rpartition(".")[0] == SEAM and module not in SEAM_FACE
        rules = module.startswith("exchange._core.rules")
        if module in ("exchange._native", "exchange._impl", "exchange._capsule_ctypes") or (inside_seam and not rules):
            found.append(f"{name}: imports {module}")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name) and node.id == "NATIVE" and isinstance(node.ctx, ast.Load):
            found.append(f"{name}:{node.lineno}: reads NATIVE")
        elif isinstance(node, ast.Attribute) and node.attr in ("NATIVE", "impl") and isinstance(node.ctx, ast.Load):
            found.append(f"{name}:{node.lineno}: reads .{node.attr}")
    return found


def test_nothing_outside_the_seam_branches_on_the_path():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted(BACKENDS.rglob("*.py")):
        name = _module_name(path)
        if name == SEAM or name.startswith(SEAM + ".") or name in READS_THE_CHOICE:
            continue
        offenders += _path_reads(path)
    assert not offenders, offenders
    for name in READS_THE_CHOICE:  # an exception that no longer reads the choice goes
        assert _path_reads(SOURCE / (name.replace(".", "/") + ".py")), f"{name} no longer reads the choice"


def test_the_seam_rule_sees_a_branch(tmp_path):
    # the check above would pass vacuously if it missed the usual ways of asking
    mod = tmp_path / "probe.py"
    mod.write_text("from ._impl import NATIVE\nfrom ._core import choice\nfrom . import _core\n"
                   "x = 1 if NATIVE else 2\ny = _core.impl\nz = _core.compiled()\n")
    found = sorted(_path_reads(mod, "exchange._probe_for_the_layout_test"))
    assert found == ["exchange._probe_for_the_layout_test: imports exchange._core.choice",
                     "exchange._probe_for_the_layout_test: imports exchange._impl",
                     "exchange._probe_for_the_layout_test:4: reads NATIVE",
                     "exchange._probe_for_the_layout_test:5: reads .impl"], found


# -- what ``import exchange`` loads ------------------------------------------------------------------
#: Modules ``import exchange`` must not load: the cross-process machinery, Ray, the CLI, chaining and
#: the framework adapters, the optional extras (metrics: prometheus_client; the bench's plots:
#: matplotlib), and the standard modules only they need.
NOT_AT_IMPORT = ["importlib.metadata", "socket", "secrets", "hmac", "selectors", "json", "multiprocessing",
                 "multiprocessing.reduction", "exchange.sharing", "exchange.sets", "exchange.chain", "exchange.frameworks",
                 "exchange.ray", "exchange.ray.objects", "exchange.ray.executor", "exchange.ray.transport",
                 "exchange.cli",
                 "exchange.devices", "exchange.devices.cpu", "exchange.channels", "ray", "torch", "jax", "cupy",
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
assert {"Chain", "share", "attach", "RayExecutor", "publish", "Snapshot"} <= set(dir(tx))
import exchange.sets as sets
assert (tx.publish, tx.draft, tx.subscribe, tx.unpublish) == (sets.publish, sets.draft, sets.subscribe, sets.unpublish)
assert (tx.Version, tx.Draft, tx.Subscription, tx.Snapshot) == (sets.Version, sets.Draft, sets.Subscription, sets.Snapshot)
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


# -- no CUDA name in device-neutral modules ---------------------------------------------------------
#: Where CUDA is the subject, and so may be named: parsing device names (``cuda:1``), the DLPack ABI
#: tables, the framework adapters, Ray's transport where it speaks to CUDA-aware peers (NIXL, Ray's
#: device names), the command-line programs, and the CUDA memory channel (with its sets' memory,
#: which exchange/sets loads by the channel's name for it). The backends (devices/)
#: are device-specific by definition, all but their protocols (``base``).
CUDA_SUBJECT = ("exchange/device.py", "exchange/_dlpack_abi.py", "exchange/frameworks/", "exchange/ray/transport.py",
                "exchange/cli/", "exchange/__main__.py", "exchange/channels/cuda.py",
                "exchange/channels/cuda_sets.py")
#: A CUDA device string: the whole string, or quoted inside a message (``device='cuda:N'``).
_CUDA_DEVICE_STRING = re.compile(r"""^cuda(_host|_managed)?(:(\d+|N))?$|['"]cuda(_host|_managed)?(:(\d+|N))?['"]""")


def _cuda_names(source: str) -> list[str]:
    """The CUDA names in ``source``: kDLCUDA* device types, imports of a CUDA module (any
    dotted part starting ``cuda`` or ``cupy``: cuda.core, cupy, exchange.devices.cuda,
    exchange.channels.cuda), and CUDA device strings outside docstrings."""
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("kDLCUDA"):
            found.append(f"{node.lineno}: {node.attr}")
        elif isinstance(node, ast.Name) and node.id.startswith("kDLCUDA"):
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _cuda_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names if re.fullmatch(r"cuda\w*|cupy\w*", a.name)]
            found += [f"{node.lineno}: from {node.module} import ..." for m in names[:1] if _cuda_module(m)]
            found += [f"{node.lineno}: import {m}" for m in names[1:]]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and _CUDA_DEVICE_STRING.search(node.value.strip()):
            found.append(f"{node.lineno}: {node.value[:50]!r}")
    return found


def _cuda_module(name: str) -> bool:
    return any(part.startswith(("cuda", "cupy")) for part in name.split("."))


def test_device_neutral_modules_name_no_cuda():
    # The core asks the backends (MemoryKind, exchange.devices.base.memory_kind) and the
    # memory channels (exchange/channels/) instead of naming a device kind.
    neutral = [p for p in PACKAGE.rglob("*.py") if not str(p.relative_to(SOURCE)).startswith(CUDA_SUBJECT)]
    neutral.append(BACKENDS / "base.py")
    offenders = {}
    for path in neutral:
        rel = str(path.relative_to(SOURCE))
        names = _cuda_names(path.read_text())
        if names:
            offenders[rel] = names
    assert not offenders, f"CUDA named in device-neutral modules (ask MemoryKind or a memory channel): {offenders}"


def test_the_cuda_name_check_sees_each_kind_of_name():
    # the check above would pass vacuously if it missed a kind of name
    planted = {
        "t == DeviceType.kDLCUDA": 1,
        "from exchange.devices import cuda": 1,
        "import cuda.core": 1,
        "from ..channels.cuda import ipc": 1,
        "d = Device.parse('cuda:0')": 1,
        "raise ValueError(\"move it to 'cuda:N' first\")": 1,
        "def f():\n    'cuda'\n": 0,  # a docstring
        "x = 'CUDA memory'; from .base import host_readable": 0,
    }
    assert {src: len(_cuda_names(src)) for src in planted} == planted
