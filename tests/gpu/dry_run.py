#!/usr/bin/env python3
"""Checks what the GPU check's dry run on the emulated device recorded (CI runs it after the
dry run's two calls, the first cut short, the second resumed):

    python3 tests/gpu/dry_run.py OUT/results.json

Every row of the emulated plan (grid.emulated_plan) is there once: the resumed call measured
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


def main():
    with open(sys.argv[1]) as f:
        results = json.load(f)
    found = problems(results)
    for line in found:
        print(f"dry run: {line}")
    if found:
        sys.exit(1)
    rows = results["speed"]
    seconds = sum(s["seconds"] for s in results["steps"].values())
    print(f"dry run: {len(rows)} speed rows, every kind, each once; steps {seconds:.0f} s in the last call")


if __name__ == "__main__":
    main()
