"""A/B of two cellc builds on the CPU: the same `cellc bench` shapes, run alternately in one run.

    python benches/ab_cli.py OLD/cellc NEW/cellc [--quick] [--rounds 3] [--json out.json]

For every shape (the cells of benches/compare_pytorch.py: lstm, gru, layernorm_lstm; T=100,
I=H, lengths uniform in [T/2, T]; B in {1, 16, 64}; H in {256, 512}; inference and training;
2 threads) it runs `cellc bench --json` with the old build, then the new one, `--rounds` times,
alternating, and keeps each build's fastest pass. It also times the streaming step (LSTM, B=1,
H=64, one step). The ratio is old / new: above 1, the new build is faster. Absolute times move
with the machine; only the ratios of one run are comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What each run reports: its fastest pass (on a shared VM, the one least disturbed).
STAT = "min_s"


def bench(cellc: str, cell: str, h: int, b: int, mode: str, steps: int, min_time: float, threads: int) -> float:
    cmd = [
        cellc, "bench", os.path.join(ROOT, "cells", f"{cell}.cell"), "-D", f"H={h}",
        "--batch", str(b), "--steps", str(steps), "--threads", str(threads), "--mode", mode,
        "--json", "--min-time", str(min_time),
    ]
    if steps > 1:
        cmd += ["--lengths", "uniform"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])[STAT]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--quick", action="store_true", help="B=16 and H=256 only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*", default=[], metavar="CELL,H,B,MODE",
                        help="these shapes only (T=100), e.g. lstm,256,1,train")
    args = parser.parse_args()

    shapes = [
        (cell, h, b, mode, 100)
        for cell in ["lstm", "gru", "layernorm_lstm"]
        for h in ([256] if args.quick else [256, 512])
        for b in ([16] if args.quick else [1, 16, 64])
        for mode in ["infer", "train"]
    ]
    shapes.append(("lstm", 64, 1, "infer", 1))  # the streaming step
    if args.only:
        picked = [s.split(",") for s in args.only]
        shapes = [(c, int(h), int(b), m, 100) for c, h, b, m in picked]
    rows = []
    print(f"{'cell':16} {'H':>4} {'B':>3} {'T':>4} {'mode':6} {'old ms':>9} {'new ms':>9} {'old/new':>8}")
    for cell, h, b, mode, steps in shapes:
        best = {"old": float("inf"), "new": float("inf")}
        for _ in range(args.rounds):
            for name in ("old", "new"):
                t = bench(getattr(args, name), cell, h, b, mode, steps, args.min_time, args.threads)
                best[name] = min(best[name], t)
        ratio = best["old"] / best["new"]
        rows.append({"cell": cell, "H": h, "B": b, "T": steps, "mode": mode,
                     "old_s": best["old"], "new_s": best["new"], "old_over_new": ratio})
        print(f"{cell:16} {h:4} {b:3} {steps:4} {mode:6} {best['old'] * 1e3:9.3f} {best['new'] * 1e3:9.3f} "
              f"{ratio:8.3f}", flush=True)
    ratios = [r["old_over_new"] for r in rows]
    geo = 1.0
    for r in ratios:
        geo *= r
    geo **= 1 / len(ratios)
    print(f"geometric mean old/new: {geo:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rounds": args.rounds, "rows": rows, "geomean": geo}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
