"""What a cell's own masks cost in training: issue 31's target (at most 10%).

    python benches/masks_speed.py target/release/cellc [--rounds 8] [--json out.json]

An LSTM with zoneout on h and c and variational dropout on its input
(benches/cells/zoneout_variational_lstm.cell: two masks drawn every step, one per sequence,
each drawn again by the backward) against cells/lstm.cell, training (forward and backward),
B=64 H=I=256 T=100, every sequence full length, 2 threads. The two runs alternate, `--rounds`
times, and each keeps its fastest pass (on a shared VM, the least disturbed one); the figure
is masked / plain - 1. Also reported: inference (evaluation: zoneout's expectation, no draws)
and each round's ratio, to show the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLS = {
    "lstm": os.path.join(ROOT, "cells", "lstm.cell"),
    "zoneout_variational_lstm": os.path.join(ROOT, "benches", "cells", "zoneout_variational_lstm.cell"),
}


def bench(cellc: str, cell: str, mode: str, args) -> float:
    cmd = [
        cellc, "bench", CELLS[cell], "-D", f"H={args.hidden}", "--batch", str(args.batch),
        "--steps", str(args.steps), "--threads", str(args.threads), "--mode", mode, "--json",
        "--min-time", str(args.min_time),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["min_s"]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cellc")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()

    results = {}
    for mode in ["train", "infer"]:
        best = {cell: float("inf") for cell in CELLS}
        ratios = []
        for _ in range(args.rounds):
            times = {cell: bench(args.cellc, cell, mode, args) for cell in CELLS}
            for cell, t in times.items():
                best[cell] = min(best[cell], t)
            ratios.append(times["zoneout_variational_lstm"] / times["lstm"])
        overhead = best["zoneout_variational_lstm"] / best["lstm"] - 1
        results[mode] = {
            "lstm_min_s": best["lstm"],
            "masked_min_s": best["zoneout_variational_lstm"],
            "overhead": overhead,
            "round_ratios": ratios,
        }
        print(f"{mode}: lstm {best['lstm'] * 1e3:.1f} ms, masked {best['zoneout_variational_lstm'] * 1e3:.1f} ms, "
              f"overhead {overhead * 100:+.1f}% (rounds {min(ratios):.3f}..{max(ratios):.3f})")
    if args.json:
        shape = {"batch": args.batch, "hidden": args.hidden, "input": args.hidden, "steps": args.steps,
                 "threads": args.threads, "rounds": args.rounds}
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "shape": shape, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
