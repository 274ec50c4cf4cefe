#!/usr/bin/env python3
"""xLSTM's sLSTM: cellc against the `xlstm` package's `vanilla` back end (the only one that runs
without its CUDA extension, and the one a CPU user has), one head, float32, on the CPU.

cellc runs the package's `slstm` pointwise function written as a `.cell`
(tests/fixtures/xlstm/slstm_one_head.cell, equal to the package to 1e-7 in tests/xlstm.rs),
with the package's weights loaded. Both get the same gate pre-activations [B, T, 4H] (what
`sLSTMLayer` feeds its cell) from the zero state.
Inference is the forward under `torch.no_grad()`; training is forward and backward of a sum.
Each shape alternates the routes, keeps each route's median, and checks that cellc's output
equals the package's first.

    python benches/slstm_speed.py [--threads 2] [--out benches/results/slstm_speed.json]

Needs torch, the cellc package and `xlstm` (`pip install --no-deps xlstm pyyaml`).
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch
from xlstm.blocks.slstm.cell import sLSTMCell, sLSTMCellConfig

import cellc

# The cell of tests/xlstm.rs, held to the package there.
SLSTM_ONE_HEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "xlstm",
                              "slstm_one_head.cell")

# The xlstm README's embedding (128) and a TiRex-like width (512); T=256; B 1 and 16.
SHAPES = [(128, 1), (128, 16), (512, 1), (512, 16)]
STEPS = 256


def pair(hidden):
    torch.manual_seed(0)
    ref = sLSTMCell(sLSTMCellConfig(hidden_size=hidden, num_heads=1, backend="vanilla", output_shape="BSH"))
    with torch.no_grad():
        ref._recurrent_kernel_.copy_(torch.randn_like(ref._recurrent_kernel_) / hidden**0.5)
        ref._bias_.copy_(torch.randn_like(ref._bias_) * 0.5)
    rnn = cellc.RNN(SLSTM_ONE_HEAD, 4 * hidden, {"H": hidden}, batch_first=True)
    rnn.load_state_dict({
        "_recurrent_kernel__l0": ref._recurrent_kernel_.detach()[0].clone(),
        "_bias__l0": ref._bias_.detach().clone(),
    })
    return ref, rnn


def route(module, train):
    def run(x):
        if train:
            x = x.detach().requires_grad_(True)
            module(x)[0].sum().backward()
        else:
            with torch.no_grad():
                module(x)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for hidden, batch in SHAPES:
        ref, rnn = pair(hidden)
        x = torch.randn(batch, STEPS, 4 * hidden)
        with torch.no_grad():
            want, got = ref(x)[0], rnn(x)[0]
        err = (want - got).abs().max().item()
        assert err < 1e-4, f"H={hidden} B={batch}: cellc differs from xlstm by {err:.2e}"
        for mode in ("infer", "train"):
            routes = {"xlstm vanilla": route(ref, mode == "train"), "cellc": route(rnn, mode == "train")}
            times = {name: [] for name in routes}
            for name, run in routes.items():
                run(x)  # warm-up (cellc compiles its kernels here)
            for _ in range(args.repeats):
                for name, run in routes.items():
                    start = time.perf_counter()
                    run(x)
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            row = {"hidden": hidden, "heads": 1, "batch": batch, "steps": STEPS, "mode": mode,
                   "xlstm_vanilla_ms": med["xlstm vanilla"] * 1e3, "cellc_ms": med["cellc"] * 1e3,
                   "speedup": med["xlstm vanilla"] / med["cellc"], "max_abs_output_diff": err}
            rows.append(row)
            print(f"H={hidden:4d} B={batch:2d} T={STEPS} {mode:5s}: xlstm vanilla {row['xlstm_vanilla_ms']:9.1f} ms"
                  f"  cellc {row['cellc_ms']:7.2f} ms  x{row['speedup']:.1f}  (outputs within {err:.1e})")
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"),
        "threads": args.threads,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
