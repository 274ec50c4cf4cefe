#!/usr/bin/env python3
"""This machine's arithmetic peak, the denominator of every speed the project reports.

    cargo build --release
    python3 benches/peak.py [--json benches/results/peak_<machine>.json]

Runs `cellc peak --json`: the rate of independent chains of the widest f32 fused multiply-add
the processor has (AVX-512, else AVX2 with FMA) and of its bf16 dot product (`vdpbf16ps`, where
it has AVX512-BF16), on one thread and on every usable core, the best of its runs
(`runtime/src/backend/cpu/peak.rs`). `cellc bench` and `benches/python_vs_nn.py` give each rate
as a fraction of it.
"""
import argparse
import json
import os
import platform
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLC = os.path.join(ROOT, "target", "release", "cellc")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--json", help="write the measurement here")
    args = ap.parse_args()
    done = subprocess.run([CELLC, "peak", "--json", "--min-time", str(args.min_time)], check=True,
                          capture_output=True, text=True)
    data = json.loads(done.stdout)
    data["meta"] = {"cpu": cpu_name(), "flags": cpu_flags(), "date": time.strftime("%Y-%m-%d")}
    for p in data["peaks"]:
        print(f"{p['kind']:<9} {p['isa']:<11} {p['threads']} thread(s): {p['gflops']:8.1f} GFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
