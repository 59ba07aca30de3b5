"""``tensor-exchange bench --plot DIR``: the bench's result as PNG figures.

matplotlib is optional (``pip install "tensor-exchange[plot]"``, or ``pip install
matplotlib``); this module imports it only when it draws, through its object-oriented
API (``matplotlib.figure.Figure`` rendered by Agg): no pyplot, no window, and the
process's own matplotlib backend is left as it was.

Figures (one PNG each, about 100 dpi; every title names the machine and the path;
``FIGURES`` maps each file to the function that draws it):

* ``hop_vs_size.png``: the import hop ``tx.from_dlpack(a)``, the export hop
  ``np.from_dlpack(t)`` and NumPy's own ``np.from_dlpack(a)`` (CuPy's on ``--device
  cuda``), in nanoseconds, against the tensor's size in bytes (log scale; the size
  sweep's rows), and beside it each tx hop over the same hop at 1 KiB sampled in the
  same rounds (``size_flatness``, with its target);
* ``hop_vs_load.png``: the import hop beside NumPy's own, against the records held live
  (0 to 100,000) and, in a second panel, against the releases pending on a blocked host
  stream (0 to 10,000), each tx point marked with its ratio to NumPy's hop in the same
  rounds; section ``release``'s ``curves``;
* ``processes.png``: the hand-off to another process (section ``share``: tx against
  ``torch.multiprocessing`` and ``multiprocessing.shared_memory`` at 1 MiB and 64 MiB,
  with the Queue's own round trip) and the Ray hop (section ``ray``: a tx.Tensor
  against a NumPy array through plain Ray), as bars with tx's ratio to each peer.

A section the run skipped (no PyTorch, no Ray) shows as a note in its panel.
``python -m exchange.cli.bench_plot RESULT.json DIR`` draws the figures from the JSON
object a ``bench --json`` run printed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import require_module

__all__ = ["EXTRA", "FIGURES", "FILES", "require_matplotlib", "write", "main"]

EXTRA = 'pip install "tensor-exchange[plot]" (or pip install matplotlib)'
DPI = 100
OURS, PEER, OTHER, THIRD = "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"


def require_matplotlib() -> Any:
    """The ``matplotlib`` module; ``tx.BackendUnavailableError`` (an ImportError) naming
    the extra where it is not installed."""
    return require_module("matplotlib", "tensor-exchange bench --plot", EXTRA)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _machine(result: dict[str, Any]) -> str:
    d = result["details"]
    m = d["machine"]
    path = "compiled core" if d.get("native") else "pure-Python path"
    run = "quick run" if d.get("config", {}).get("quick") else "full run"
    return f"{m['cpu_model']}, {m['cpu_count']} CPUs; Python {m['python']}, NumPy {m['numpy']}; {path}; {run}"


def _figure(panels: int, title: str, result: dict[str, Any]) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * panels if panels > 1 else 7.2, 4.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0].tolist()
    fig.suptitle(f"{title}\n{_machine(result)}", fontsize=10)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
    return fig, axes


def _note(ax: Any, text: str) -> None:
    import textwrap

    # Wrapped here: matplotlib's wrap=True wraps at the figure's edge, not the panel's.
    ax.text(0.5, 0.5, textwrap.fill(text, 60), ha="center", va="center", fontsize=9, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig: Any, path: Path) -> Path:
    """Render with Agg and write a palette PNG (256 colours: a few tens of KB, where
    matplotlib's own RGBA PNG of the same figure is about 80 KB)."""
    import io

    from PIL import Image  # Pillow: a requirement of matplotlib

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png", metadata={"Software": None})
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(path, format="PNG", optimize=True)
    return path


def _hop_names(d: dict[str, Any]) -> tuple[str, str, str]:
    """Labels: import, export and the peer's own hop (NumPy's, or CuPy's on CUDA)."""
    imp = d.get("import_hop", {})
    exp = d.get("export_hop", {})
    return (f"tx import  {imp.get('ours', 'tx.from_dlpack(a)')}",
            f"tx export  {exp.get('ours', 'np.from_dlpack(t)').replace('tx_tensor', 't')}",
            f"peer  {imp.get('peer', 'np.from_dlpack(a)')}")


def _size_axis(ax: Any, x: list[int], device: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [_bytes(n) for n in x], rotation=30 if len(x) > 6 else 0)
    ax.minorticks_off()
    ax.set_xlabel(f"tensor size (bytes, float32, on {device}; log scale)")


def plot_sizes(result: dict[str, Any], path: Path) -> Path:
    d = result["details"]
    fig, (ax, rel) = _figure(2, "DLPack hop cost against tensor size (zero-copy: the same at every size)", result)
    rows = d["sizes"]["rows"]
    x = [r["bytes"] for r in rows]
    device = d.get("device", "cpu")
    imp, exp, peer = _hop_names(d)
    for key, label, color, marker in (("import_ns", imp, OURS, "o"), ("export_ns", exp, OTHER, "s"),
                                      ("numpy_ns", peer, PEER, "^")):
        ax.plot(x, [r[key] for r in rows], marker=marker, color=color, label=label)
    _size_axis(ax, x, device)
    ax.set_ylim(0, max(max(r[k] for r in rows) for k in ("import_ns", "export_ns", "numpy_ns")) * 1.3)
    ax.set_ylabel("one hop, result dropped (ns, median)")
    ax.set_title("each hop beside the peer's own, sampled in turn", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    for key, label, color, marker in (("import_vs_1k", "tx import", OURS, "o"),
                                      ("export_vs_1k", "tx export", OTHER, "s")):
        rel.plot(x, [r[key] for r in rows], marker=marker, color=color, label=label)
    target = d.get("targets", {}).get("size_flatness")
    if target:
        rel.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target (size_flatness <= {target:g})")
    rel.axhline(1.0, color="black", linewidth=0.8)
    _size_axis(rel, x, device)
    rel.set_ylim(0, max(2.0, (target or 0) * 1.2, *(r[k] * 1.2 for r in rows for k in ("import_vs_1k",
                                                                                          "export_vs_1k"))))
    rel.set_ylabel("over the same hop at 1 KiB, same rounds (x)")
    rel.set_title(f"relative to 1 KiB: size_flatness {result.get('size_flatness', float('nan')):.2f} "
                  f"at {_bytes(x[-1])}", fontsize=9)
    rel.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _ratio(row: dict[str, Any]) -> float:
    """tx over NumPy at one point of a curve: the median of per-round ratios where the
    run gave it, else the ratio of the medians."""
    return row.get("ratio") or row["tx_ns"] / row["numpy_ns"]


def plot_load(result: dict[str, Any], path: Path) -> Path:
    d = result["details"]
    fig, axes = _figure(2, "Import hop against what the registry holds (1 KiB float32, host)", result)
    curves = d.get("sections", {}).get("release", {}).get("details", {}).get("curves")
    if not curves:
        for ax in axes:
            _note(ax, "not measured in this run (section release has no curves)")
        return _save(fig, path)
    top = 0.0
    for ax, key, count, xlabel in ((axes[0], "live", "held", "records held live (symlog scale)"),
                                   (axes[1], "pending", "made", "releases pending on a blocked host stream "
                                                                "(symlog scale)")):
        rows = curves[key]
        x = [r[count] for r in rows]
        ax.plot(x, [r["tx_ns"] for r in rows], marker="o", color=OURS, label="tx.from_dlpack(a) (over NumPy's)")
        for n, r in zip(x, rows):  # the ratio in the same rounds: what the machine's drift leaves alone
            ax.annotate(f"{_ratio(r):.2f}x", (n, r["tx_ns"]), xytext=(0, 6),
                        textcoords="offset points", ha="center", fontsize=7, color=OURS)
        ax.plot(x, [r["numpy_ns"] for r in rows], marker="^", color=PEER,
                label="np.from_dlpack(a), same rounds (knows no registry)")
        ax.set_xscale("symlog", linthresh=100)
        ax.set_xticks(x, [f"{n:,}" for n in x])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel("one hop, result dropped (ns, median)")
        top = max(top, *(r["tx_ns"] for r in rows), *(r["numpy_ns"] for r in rows))
        first, last = _ratio(rows[0]), _ratio(rows[-1])
        ax.set_title(f"tx over NumPy's hop: {first:.2f}x at 0, {last:.2f}x at {x[-1]:,}", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    for ax in axes:
        ax.set_ylim(0, top * 1.3)
    return _save(fig, path)


def _bars(ax: Any, groups: list[str], series: list[tuple[str, str, list[float]]], unit: str) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series (label, colour,
    values; NaN leaves the bar out); each peer's bar says tx's ratio to it."""
    n = len(series)
    width = 0.8 / n
    top = max((v for _, _, vals in series for v in vals if v == v), default=1.0)
    for i, (label, color, values) in enumerate(series):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        kept = [(x, v) for x, v in zip(xs, values) if v == v]
        if not kept:
            continue
        bars = ax.bar([x for x, _ in kept], [v for _, v in kept], width * 0.92, color=color, label=label)
        for bar, (g, v) in zip(bars, [(xs.index(x), v) for x, v in kept]):
            text = f"{v:,.0f} {unit}"
            ours = series[0][2][g]
            if i and ours == ours:
                text += f"\ntx / this: {ours / v:.2f}"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, v), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(0, top * 1.75)  # room above the bars for the legend


def plot_processes(result: dict[str, Any], path: Path) -> Path:
    sections = result["details"].get("sections", {})
    fig, (left, right) = _figure(2, "Handing a tensor to another process, and to another Ray actor", result)
    share = sections.get("share", {}).get("details")
    if not share or "rows" not in share:
        _note(left, f"share: not measured ({(share or {}).get('skipped', 'no section share in this run')})")
    else:
        rows = share["rows"]
        nan = math.nan
        _bars(left, [f"{_bytes(r['bytes'])}" for r in rows], [
            ("tx.empty(shared=True) on a Queue", OURS, [r["tx_us"] for r in rows]),
            ("torch share_memory_() on a torch.mp Queue", PEER,
             [r["torch_us"] if share.get("torch", True) else nan for r in rows]),
            ("shared_memory name on a Queue, attached each time", OTHER, [r.get("shm_us", nan) for r in rows]),
        ], "us")
        queue = share.get("queue_int_us")
        if queue:
            left.axhline(queue, color="grey", linestyle="--", linewidth=1,
                         label=f"the Queue's own round trip (an int): {queue:,.0f} us")
        left.set_title("multiprocessing Queue (spawn), worker reads one element and replies", fontsize=9)
        left.set_xlabel("tensor size (uint8)")
        left.set_ylabel("put to reply (us, median)")
        left.legend(fontsize=7, loc="upper left")
    ray = sections.get("ray", {}).get("details")
    if not ray or "skipped" in ray:
        _note(right, f"ray: skipped ({(ray or {}).get('skipped', 'no section ray in this run')})")
    else:
        _bars(right, [f"{_bytes(ray['bytes'])} float32, actor to actor"], [
            ("tx.Tensor (its serializer, read-only view of the store)", OURS, [ray["tx_ns"] / 1e3]),
            ("NumPy array, plain Ray", PEER, [ray["ray_numpy_ns"] / 1e3]),
        ], "us")
        right.set_title(f"Ray {ray.get('ray', '')}: through the object store, "
                        f"ray.get(b.take.remote(a.give.remote()))", fontsize=9)
        right.set_ylabel("one hop, driver waits for the answer (us, median)")
        right.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


#: The figures :func:`write` draws, in order: file name -> the function that draws it
#: (``(result, path) -> path``). A new figure is one function and one row here.
FIGURES: dict[str, Callable[[dict[str, Any], Path], Path]] = {
    "hop_vs_size.png": plot_sizes,
    "hop_vs_load.png": plot_load,
    "processes.png": plot_processes,
}
#: The files :func:`write` makes, in order.
FILES = tuple(FIGURES)


def write(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """Draw the figures of ``result`` (what ``bench.measure()`` returns, or the object
    ``--json`` prints) into ``directory`` (made if missing), as :data:`FIGURES`. Returns
    the paths written.

    Raises
    ------
    tx.BackendUnavailableError
        (an ImportError) matplotlib is not installed; the message names the extra.
    """
    require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    return [draw(result, out / name) for name, draw in FIGURES.items()]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m exchange.cli.bench_plot RESULT.json DIR``: the figures of a saved
    ``bench --json`` result."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m exchange.cli.bench_plot",
                                     description="Draw tensor-exchange bench's figures from its --json output.")
    parser.add_argument("result", help="a file holding the JSON object that tensor-exchange bench --json printed")
    parser.add_argument("directory", help="where the PNG files go (made if missing)")
    args = parser.parse_args(argv)
    try:
        result = json.loads(Path(args.result).read_text())
        paths = write(result, args.directory)
    except (ImportError, OSError, ValueError, KeyError) as exc:
        print(f"bench_plot: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
