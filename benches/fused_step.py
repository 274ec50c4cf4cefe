#!/usr/bin/env python3
"""The fused step against the unfused one: `cellc bench` and `cellc bench --unfused`, alternating.

    cargo build --release
    python3 benches/fused_step.py [--rounds 5] [--json benches/results/fused_step_<machine>.json]

A cell whose per-step pointwise stage the compiler fuses runs each thread's share of the
products and of that stage together (`runtime/src/backend/cpu/tiles.rs`): where a step's
threads split its units (below two sequences a thread), with one barrier a step; where each
owns its sequences (from eight a thread), tile by tile with the input projection, which then
runs in the step instead of before the loop (a cell whose step does not fuse, such as the
LayerNorm-LSTM, runs it at each step's start: `runtime/src/backend/cpu/sink.rs`). In training,
below two sequences a thread, the backward step runs split by units too
(`runtime/src/backend/cpu/unit_split.rs`); `--unfused` turns both off. This times both ways, same binary, same run,
alternating, `--rounds` times each, over LSTM and GRU at B 1-64 and H 128-512, T=100, 2
threads, every sequence full length, inference and training, and keeps each side's median.
`fused` is what the runtime chose at that batch (B=4 runs unfused either way on 2 threads);
ratio = unfused time / fused time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak import CELLC, ROOT, cpu_name  # noqa: E402

SHAPES = [("lstm", 1, 128, "infer"), ("lstm", 1, 256, "infer"), ("lstm", 1, 512, "infer"),
          ("lstm", 2, 256, "infer"), ("lstm", 3, 256, "infer"), ("gru", 1, 256, "infer"),
          ("gru", 2, 256, "infer"),
          ("lstm", 16, 256, "infer"), ("lstm", 64, 256, "infer"), ("lstm", 64, 512, "infer"),
          ("gru", 16, 256, "infer"), ("gru", 64, 512, "infer"),
          ("layernorm_lstm", 16, 256, "infer"), ("layernorm_lstm", 64, 512, "infer"),
          ("lstm", 16, 256, "train"), ("lstm", 64, 512, "train"), ("gru", 16, 256, "train")]


def bench(cell, b, h, mode, threads, unfused):
    cmd = [CELLC, "bench", os.path.join(ROOT, "cells", f"{cell}.cell"), "-D", f"H={h}", "-D", f"I={h}",
           "--batch", str(b), "--steps", "100", "--mode", mode, "--threads", str(threads),
           "--min-time", "0.3", "--json"]
    out = subprocess.run(cmd + (["--unfused"] if unfused else []), check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["median_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for cell, b, h, mode in SHAPES:
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for unfused in (False, True):
                times[unfused].append(bench(cell, b, h, mode, args.threads, unfused))
        fused_s, unfused_s = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"cell": cell, "batch": b, "hidden": h, "steps": 100, "mode": mode,
                     "fused_s": fused_s, "unfused_s": unfused_s, "ratio": unfused_s / fused_s})
        print(f"{cell:<14} B={b:<2} H={h:<4} {mode} fused {fused_s * 1e3:7.3f} ms  unfused {unfused_s * 1e3:7.3f} ms  "
              f"ratio {unfused_s / fused_s:.3f}", flush=True)
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "rounds": args.rounds,
                "cpu": cpu_name()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
