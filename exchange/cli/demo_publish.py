"""``tensor-exchange demo --publish``: a trainer publishes its weights as a tensor set
after each epoch; two reader processes follow the newest version.

The trainer (this process) trains the digits classifier of the main demo (the 8x8 digits
scikit-learn ships, the same stratified split) with PyTorch: a 64-64-10 ReLU MLP, plain
SGD with momentum, one pass over the training images per epoch. After each epoch it publishes its
weights (``tx.publish``, which copies them into the set's shared memory) with a
``meta`` tensor: the epoch, whether it is the last version, and a checksum (CRC-32 of
the weights' bytes in key order) the trainer computed before publishing.

Two reader processes (spawn), one JAX and one NumPy, subscribe to the set and take each
new version (``Subscription.next()``), import every weight into their framework
(``jax.numpy.from_dlpack`` / ``np.from_dlpack``) and, per version: check that the
framework's data pointer is the tensor's and lies in a shared, read-only mapping of the
process (``/proc/self/maps``: read without a copy, from the set's memory), recompute
the checksum from their framework's view (no torn version: it must equal the one the
trainer computed, both the one in the set and the one it reports), and score the
held-out images. At the end each process reports its registry's live records.

So that every version is seen, the trainer starts the next epoch once both readers have
reported on the version it published (``next()`` alone would skip versions published
while a reader was busy; the readers do not rely on the pacing for correctness).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
import zlib
from typing import Any

from . import write_report

__all__ = ["PublishResult", "run_publish_demo", "report_json", "print_text", "main", "READERS", "EPOCHS"]

#: The reader processes: name -> framework.
READERS = ("jax", "numpy")
#: Epochs trained (one version published after each).
EPOCHS = 6
#: The final version's held-out accuracy must reach this.
MIN_ACCURACY = 0.9
_TIMEOUT = 120.0
_KEYS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def checksum(arrays: list[Any]) -> int:
    """CRC-32 of the arrays' bytes, one after the other (NumPy arrays, C-contiguous)."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(memoryview(a).cast("B"), crc)
    return crc


def _mapping(address: int) -> tuple[str, str]:
    """(permissions, file name) of the mapping of this process holding ``address``."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(None, 5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return parts[1], parts[5].strip() if len(parts) > 5 else ""
    return "", ""


def _reader(framework: str, name: str, x_test: Any, y_test: Any, conn: Any) -> None:
    """Follow the set ``name`` until its last version; send a report per version, then
    ``("end", live_records)``."""
    import numpy as np

    import exchange as tx

    if framework == "jax":
        import jax.numpy as jnp

        def load(t: Any) -> tuple[Any, int]:
            a = jnp.from_dlpack(t)
            return a, a.unsafe_buffer_pointer()

        def view(a: Any) -> Any:
            return np.asarray(a)  # a read of the JAX array (for the checksum and the scoring)
    else:
        def load(t: Any) -> tuple[Any, int]:
            a = np.from_dlpack(t)
            return a, a.ctypes.data

        def view(a: Any) -> Any:
            return a

    x = np.asarray(x_test, dtype=np.float32) / 16.0
    y = np.asarray(y_test)
    try:
        with tx.subscribe(name) as sub:
            conn.send(("ready",))
            while True:
                with sub.next(timeout=_TIMEOUT) as snap:
                    meta = np.from_dlpack(snap["meta"]).tolist()
                    arrays, zero_copy, maps = {}, True, set()
                    for key in _KEYS:
                        t = snap[key]
                        a, ptr = load(t)
                        perms, where = _mapping(ptr)
                        # shared ("s") and not writable: the set's sealed memory, not a copy
                        zero_copy &= ptr == t.data_ptr and perms[1:2] == "-" and perms[3:4] == "s"
                        maps.add(f"{perms} {where}")
                        arrays[key] = a
                    host = {k: np.ascontiguousarray(view(a)) for k, a in arrays.items()}
                    crc = checksum([host[k] for k in _KEYS])
                    h = np.maximum(x @ host["fc1.weight"].T + host["fc1.bias"], 0.0)
                    accuracy = float(((h @ host["fc2.weight"].T + host["fc2.bias"]).argmax(1) == y).mean())
                    version = snap.version
                    del arrays, host, t, a
                conn.send(("version", {"version": int(version), "epoch": int(meta[0]), "accuracy": accuracy,
                                       "checksum": int(crc), "checksum_in_set": int(meta[2]),
                                       "zero_copy": bool(zero_copy), "mappings": sorted(maps)}))
                if meta[1]:
                    break
    except Exception as exc:  # reported to the trainer, which fails the check with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    gc.collect()
    tx.registry().collect(timeout=10)
    conn.send(("end", int(tx.registry().stats()["live_records"])))


@dataclasses.dataclass
class PublishResult:
    """What ``run_publish_demo`` found: the versions published (version, epoch, checksum,
    training loss), each reader's reports per version and its live records at the end
    (None if it never said), errors, and the trainer's live records at the end."""

    set_name: str
    published: list[dict[str, Any]]
    readers: dict[str, dict[str, Any]]
    live_records_end: int
    errors: list[str]
    seconds: float

    def checks(self) -> dict[str, bool]:
        crcs = {p["version"]: p["checksum"] for p in self.published}
        seen = [r for rd in self.readers.values() for r in rd["versions"]]
        finals = [rd["versions"][-1]["accuracy"] for rd in self.readers.values() if rd["versions"]]
        firsts = [rd["versions"][0]["accuracy"] for rd in self.readers.values() if rd["versions"]]
        return {
            "every_reader_saw_versions": all(rd["versions"] for rd in self.readers.values()),
            "accuracy_rising": len(finals) == len(self.readers)
            and all(f > s and f >= MIN_ACCURACY for f, s in zip(finals, firsts)),
            "zero_copy": bool(seen) and all(r["zero_copy"] for r in seen),
            "no_torn_version": bool(seen) and all(r["checksum"] == r["checksum_in_set"] == crcs.get(r["version"])
                                                  for r in seen),
            "no_records_alive": self.live_records_end == 0
            and all(rd["live_records_end"] == 0 for rd in self.readers.values()),
            "no_errors": not self.errors,
        }

    @property
    def ok(self) -> bool:
        return all(self.checks().values())


def _train(seed: int) -> tuple[Any, Any, Any]:
    """(the model, the training batches' iterator maker, the held-out split)."""
    import torch

    from .demo_parts import load_digits_split

    data = load_digits_split(seed=seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x = torch.tensor(data.x_train, dtype=torch.float32) / 16.0
    y = torch.tensor(data.y_train, dtype=torch.long)
    return model, (x, y), data


def run_publish_demo(*, seed: int = 0, epochs: int = EPOCHS, progress: bool = False) -> PublishResult:
    """Train, publish a version per epoch, and collect the readers' reports (see the
    module docstring). Raises nothing for a failed check: the result says it."""
    import multiprocessing

    import torch

    import exchange as tx

    def say(msg: str) -> None:
        if progress:
            print(f"demo --publish: {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    model, (x, y), data = _train(seed)
    name = f"tx-demo-weights-{os.getpid()}"
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = {}, {}
    for fw in READERS:
        here, there = ctx.Pipe()
        procs[fw] = ctx.Process(target=_reader, args=(fw, name, data.x_test, data.y_test, there), daemon=True)
        pipes[fw] = here
    published: list[dict[str, Any]] = []
    readers = {fw: {"framework": fw, "versions": [], "live_records_end": None} for fw in READERS}
    errors: list[str] = []

    def receive(fw: str) -> Any:
        if not pipes[fw].poll(_TIMEOUT):
            raise TimeoutError(f"the {fw} reader said nothing for {_TIMEOUT:g} s")
        msg = pipes[fw].recv()
        if msg[0] == "error":
            errors.append(f"{fw} reader: {msg[1]}")
        return msg

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    try:
        # the first version before the readers start: their subscription finds the set
        first = _weights(model, 0, False)
        version = tx.publish(name, first)
        published.append({"version": version.number, "epoch": 0, "loss": None,
                          "checksum": int(first["meta"][2]), "nbytes": version.nbytes})
        for fw in READERS:
            procs[fw].start()
        say("readers starting (JAX's import takes a few seconds)")
        for fw in READERS:
            if receive(fw)[0] != "ready":
                raise RuntimeError(f"the {fw} reader failed: {errors}")
        for epoch in range(1, epochs + 1):
            loss = _epoch(torch, model, optimizer, x, y, generator)
            tensors = _weights(model, epoch, epoch == epochs)
            version = tx.publish(name, tensors)
            published.append({"version": version.number, "epoch": epoch, "loss": loss,
                              "checksum": int(tensors["meta"][2]), "nbytes": version.nbytes})
            say(f"epoch {epoch}: published version {version.number} (loss {loss:.3f})")
            for fw in READERS:  # pacing: each reader reports on this version before the next epoch
                while not errors:
                    msg = receive(fw)
                    if msg[0] == "version":
                        readers[fw]["versions"].append(msg[1])
                        if msg[1]["version"] >= version.number:
                            break
                    elif msg[0] == "end":
                        readers[fw]["live_records_end"] = msg[1]
                        break
            if errors:
                break
        for fw in READERS:
            while readers[fw]["live_records_end"] is None:
                msg = receive(fw)
                if msg[0] == "end":
                    readers[fw]["live_records_end"] = msg[1]
    except (TimeoutError, RuntimeError, OSError, EOFError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for proc in procs.values():
            if proc.pid is not None:
                proc.join(_TIMEOUT if not errors else 5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
        try:
            tx.unpublish(name)
        except Exception as exc:  # noqa: BLE001  (reported: the check fails with it)
            errors.append(f"unpublish: {type(exc).__name__}: {exc}")
    del optimizer, model
    gc.collect()
    tx.registry().collect(timeout=10)
    live = int(tx.registry().stats()["live_records"])
    return PublishResult(name, published, readers, live, errors, time.perf_counter() - started)


def _epoch(torch: Any, model: Any, optimizer: Any, x: Any, y: Any, generator: Any, batch: int = 64) -> float:
    """One pass of SGD over the training images in a shuffled order; the mean loss."""
    order = torch.randperm(len(x), generator=generator)
    total = 0.0
    for i in range(0, len(x), batch):
        idx = order[i:i + batch]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        total += float(loss.detach()) * len(idx)
    return total / len(x)


def _weights(model: Any, epoch: int, last: bool) -> dict[str, Any]:
    """The model's weights (PyTorch tensors, detached) and ``meta``: int64 [epoch, last,
    CRC-32 of the weights' bytes in key order]."""
    import numpy as np
    import torch

    layers = model.state_dict()  # Sequential's names: 0.* and 2.* (1 is the ReLU)
    state = {k: layers[k.replace("fc1", "0").replace("fc2", "2")].detach().contiguous() for k in _KEYS}
    crc = checksum([state[k].numpy() for k in _KEYS])
    return {**state, "meta": torch.tensor(np.array([epoch, int(last), crc], dtype=np.int64))}


# -- reports ----------------------------------------------------------------------------------
def report_json(result: PublishResult) -> dict[str, Any]:
    """The ``--report json`` object::

        {"set": str, "published": [{"version": int, "epoch": int, "loss": float | None (epoch 0: untrained),
                                    "checksum": int, "nbytes": int}],
         "readers": {"jax" | "numpy": {"framework": str, "live_records_end": int | None,
                     "versions": [{"version": int, "epoch": int, "accuracy": float, "checksum": int,
                                   "checksum_in_set": int, "zero_copy": bool, "mappings": [str]}]}},
         "live_records_end": int, "errors": [str], "checks": {name: bool}, "ok": bool, "seconds": float}
    """
    return {"set": result.set_name, "published": result.published, "readers": result.readers,
            "live_records_end": result.live_records_end, "errors": result.errors, "checks": result.checks(),
            "ok": result.ok, "seconds": round(result.seconds, 3)}


def print_text(result: PublishResult, file: Any = None) -> None:
    """The report for people: the versions published, what each reader saw, the checks."""
    out = file or sys.stdout
    print(f"tensor-exchange demo --publish: a PyTorch trainer publishes set {result.set_name!r} after each epoch",
          file=out)
    for p in result.published:
        loss = "untrained" if p["loss"] is None else f"loss {p['loss']:.3f}"
        print(f"  version {p['version']}: epoch {p['epoch']}, {loss}, {p['nbytes']:,} bytes, "
              f"checksum {p['checksum']:08x}", file=out)
    for fw, rd in result.readers.items():
        maps = sorted({m for r in rd["versions"] for m in r.get("mappings", [])})
        where = f"data pointers in the set's mapping{'s' if len(maps) > 1 else ''} {', '.join(maps)}; " if maps else ""
        print(f"{fw} reader ({where}live records at the end: {rd['live_records_end']}):", file=out)
        for r in rd["versions"]:
            print(f"  version {r['version']} (epoch {r['epoch']}): accuracy {r['accuracy']:.3f}, "
                  f"{'read in place' if r['zero_copy'] else 'COPIED'}, checksum "
                  f"{'ok' if r['checksum'] == r['checksum_in_set'] else 'TORN'}", file=out)
    for e in result.errors:
        print(f"error: {e}", file=out)
    checks = result.checks()
    print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()), file=out)
    print(f"{'ok' if result.ok else 'FAILED'} ({result.seconds:.1f} s)", file=out)


def main(args: Any) -> int:
    """Run the demo and print its report; exit status 0 when every check holds, else 1."""
    from .demo_parts import _stdout_to_stderr

    if getattr(args, "report", "text") == "json":
        with _stdout_to_stderr():
            result = run_publish_demo(seed=args.seed, progress=True)
        write_report(lambda: sys.stdout.write(json.dumps(report_json(result)) + "\n"))
    else:
        result = run_publish_demo(seed=args.seed, progress=True)
        write_report(lambda: print_text(result))
    return 0 if result.ok else 1
