#!/usr/bin/env python3
"""Where a CPU pass's time goes, over a grid of shapes: `cellc bench --profile` for each.

    cargo build --release
    python3 benches/profile_grid.py [--quick] [--json benches/results/profile_<machine>.json]

For each cell (LSTM, GRU, LayerNorm-LSTM), B in {16, 64}, H in {256, 512}, T=100, every
sequence at full length (no padding to skip), inference and training, on 2 threads: the pass's
rate as a fraction of this machine's measured peak (`cellc peak`) and each phase's share of the
pass (setup, the stages before the loop, the loop's products, pointwise kernels, barrier
waits and bookkeeping, a whole-sequence kernel, the stages after the loop). The breakdown a
change to the step is measured against, before and after.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak import CELLC, ROOT, cpu_name  # noqa: E402


def profile(cell, b, h, mode, threads, min_time):
    cmd = [CELLC, "bench", os.path.join(ROOT, "cells", f"{cell}.cell"), "-D", f"H={h}", "-D", f"I={h}",
           "--batch", str(b), "--steps", "100", "--mode", mode, "--threads", str(threads),
           "--min-time", str(min_time), "--json", "--profile"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B=16 and H=256 only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for cell in ["lstm", "gru", "layernorm_lstm"]:
        for b in [16] if args.quick else [16, 64]:
            for h in [256] if args.quick else [256, 512]:
                for mode in ["infer", "train"]:
                    r = profile(cell, b, h, mode, args.threads, args.min_time)
                    phases = r["profile"]
                    timed = sum(phases.values())
                    shares = {k: v / timed for k, v in phases.items() if v > 0}
                    rows.append({"cell": cell, "batch": b, "hidden": h, "steps": 100, "mode": mode,
                                 "median_s": r["median_s"], "gflops": r["gflops"],
                                 "peak_fraction": r.get("peak_fraction"), "phases_s": phases})
                    top = ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
                    print(f"{cell:<15}B={b:<3} H={h:<4} {mode:<6} {r['median_s'] * 1e3:8.3f} ms  "
                          f"{(r.get('peak_fraction') or 0):4.0%} of peak  {top}", flush=True)
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "cpu": cpu_name()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
