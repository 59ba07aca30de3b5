"""The Chrome trace event format's rules that tx.trace() files keep, checked for the
trace tests (tests/cpu/test_trace.py, test_ray.py)."""

from __future__ import annotations

from collections import defaultdict

PHASES = {"M", "X", "i", "b", "e", "s", "f", "C"}


def check_format(doc: dict) -> list[dict]:
    """The trace event format's rules this library's traces keep; returns the events."""
    assert set(doc) >= {"traceEvents", "displayTimeUnit", "otherData"}
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    last_ts = None
    open_async: dict[tuple, int] = defaultdict(int)
    flows: dict[int, set] = defaultdict(set)
    for e in events:
        assert e["ph"] in PHASES, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "M":
            assert last_ts is None, "metadata comes first"
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index") and "args" in e
            continue
        assert isinstance(e["ts"], (int, float)) and isinstance(e["cat"], str), e
        if last_ts is not None:
            assert e["ts"] >= last_ts, ("times go back", e)
        last_ts = e["ts"]
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] in ("b", "e"):
            key = (e["pid"], e["cat"], e["name"], e["id2"]["local"])
            open_async[key] += 1 if e["ph"] == "b" else -1
            assert open_async[key] >= 0, ("an end before its begin", e)
        if e["ph"] in ("s", "f"):
            flows[e["id"]].add(e["ph"])
        if e["ph"] == "f":
            assert e["bp"] == "e"
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
    assert not [k for k, n in open_async.items() if n], "every begin has its end"
    assert all(ends == {"s", "f"} for ends in flows.values()), "every flow has both ends"
    return events


def spans_inside(events: list[dict]) -> None:
    """Every flow end and hop instant lies inside a span of its own track."""
    spans = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for e in events:
        if e["ph"] in ("s", "f", "i") and e["cat"] in ("batch", "hop"):
            assert any(a <= e["ts"] <= b for a, b in spans[e["tid"]]), e
