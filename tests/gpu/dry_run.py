#!/usr/bin/env python3
"""Checks what the GPU check's dry run on the emulated device recorded (CI runs it after the
dry run's two calls, the first cut short, the second resumed):

    python3 tests/gpu/dry_run.py OUT/results.json

The plan keeps its promises (a cut after its first four units leaves one row of each kind; the
whole fits two calls; the emulated plan has every kind the real one has). Every row of the
emulated plan (grid.emulated_plan) is there once: the resumed call measured
what the first left and nothing twice. Every Python row ran cellc and has its errors against
float64 (the gradients' too in training) within bounds, and PyTorch's time; every bench row ran
`cellc bench`; every profile row profiled cellc; every kind (each cell, mode and precision; bench
in each precision; each shape class; each tier) is there; the speed step passed. Standard library
only; exits 1 naming what is missing.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402


def problems(results):
    rows = results.get("speed", [])
    keys = [grid.key_of(r) for r in rows]
    found = []
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        found.append(f"measured twice: {twice}")
    wanted = [k for task in grid.plan(emulated=True) for k in grid.keys(task)]
    missing = sorted(set(wanted) - set(keys))
    if missing:
        found.append(f"not measured: {missing}")
    for r in rows:
        key = grid.key_of(r)
        if r["status"] != "measured":
            found.append(f"{key}: {r['status']} ({r.get('cellc_error') or r.get('errors')})")
        elif r["source"] == "python":
            errors = r["errors"]["cellc"] or {}
            if "output" not in errors or (r["mode"] == "train" and "grads" not in errors):
                found.append(f"{key}: no error against float64 ({r['errors']})")
            if not r["torch_ms"] and not r.get("torch_failed"):
                found.append(f"{key}: no PyTorch time ({r.get('torch_failed')})")
        elif r["source"] == "profile" and "wall_ms" not in r.get("cellc", {}):
            found.append(f"{key}: no profile of cellc ({r.get('cellc')})")
    kinds = {(r["source"], r["cell"], r["mode"], r["precision"]) for r in rows}
    for cell in grid.CELLS:
        for mode in grid.MODES:
            for precision in grid.PRECISIONS:
                if ("python", cell, mode, precision) not in kinds:
                    found.append(f"no Python row of {cell} {mode} in {precision}")
    for precision in grid.PRECISIONS:
        if not any(r["source"] == "bench" and r["precision"] == precision for r in rows):
            found.append(f"no bench row in {precision}")
    labels = {r.get("label") for r in rows if r["source"] == "profile"}
    if labels != set(grid.SHAPE_CLASSES):
        found.append(f"profiles of {sorted(labels)}, not of every shape class {sorted(grid.SHAPE_CLASSES)}")
    tiers = {r["tier"] for r in rows}
    if tiers != {"core", "T=100", "T=1000"}:
        found.append(f"tiers {sorted(tiers)}")
    step = results["steps"].get("speed", {})
    if step.get("status") != "passed":
        found.append(f"the speed step: {step}")
    return found


# What the speed step may take on an H100 by grid.py's estimates: what one 540 s call leaves
# after the correctness steps (about 135 s), and a second call of 240 s.
SPEED_SECONDS = (540 - 135) + (240 - 10)


def plan_problems():
    """The GPU plan's promises: a cut after its first four units still leaves f32 and bf16,
    small and large, LSTM and LayerNorm-LSTM; the whole fits two calls; the emulated plan has
    every kind of task the real one has."""
    found = []
    real, emulated = grid.plan(), grid.plan(emulated=True)
    first = [t for t in real if isinstance(t, grid.Unit)][:4]
    if {(u.cell, u.shape) for u in first} != {(c, s) for c in ("lstm", "layernorm_lstm")
                                              for s in grid.CORE_SHAPES.values()}:
        found.append(f"the plan's first four units are not LSTM and LayerNorm-LSTM, small and large: {first}")
    if any(not {"f32", "bf16"} <= set(u.precisions) for u in first):
        found.append("the plan's first four units do not all run f32 and bf16")
    compiled = set()
    total = sum(grid.seconds(t, compiled) for t in real)
    if total > SPEED_SECONDS:
        found.append(f"the plan is estimated at {total:.0f} s, more than two calls give ({SPEED_SECONDS} s)")

    def kinds(tasks):
        out = set()
        for t in tasks:
            if isinstance(t, grid.Unit):
                out |= {("python", t.cell, t.mode, p, t.tier) for p in t.precisions}
                out |= {("bench", p) for p in t.bench}
            else:
                out.add(("profile", t.label))
        return out

    python = lambda ks: {k[:4] for k in ks if k[0] == "python"}  # noqa: E731
    rest = lambda ks: {k for k in ks if k[0] != "python"} | {("tier", k[4]) for k in ks if k[0] == "python"}  # noqa: E731
    missing = (python(kinds(real)) - python(kinds(emulated))) | (rest(kinds(real)) - rest(kinds(emulated)))
    if missing:
        found.append(f"the emulated plan lacks {sorted(missing)}")
    return found


def main():
    with open(sys.argv[1]) as f:
        results = json.load(f)
    found = plan_problems() + problems(results)
    for line in found:
        print(f"dry run: {line}")
    if found:
        sys.exit(1)
    rows = results["speed"]
    seconds = sum(s["seconds"] for s in results["steps"].values())
    print(f"dry run: {len(rows)} speed rows, every kind, each once; steps {seconds:.0f} s in the last call")


if __name__ == "__main__":
    main()
