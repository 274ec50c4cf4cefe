#!/usr/bin/env python3
"""xLSTM's sLSTM on the CPU: cellc's `slstm` cell (cells/slstm.cell, 4 heads) against the `xlstm`
package's `vanilla` back end (the only one that runs without its CUDA extension, and the one a CPU
user has), and against the same cell written with a dense recurrent product, float32.

- `xlstm vanilla`: the package's sLSTMCell, 4 heads.
- `cellc heads`: cells/slstm.cell with the package's weights loaded unchanged (held to the
  package to 1e-5 in tests/xlstm.rs).
- `cellc dense`: the same cell with one dense [4H, H] recurrent matrix (the block-diagonal one
  written out, gate-major, zeros off the diagonal blocks): what a cell without heads must do.
  It computes the same outputs with `heads` times the recurrent products.

All get the same gate pre-activations [B, T, 4H] (what `sLSTMLayer` feeds its cell) from the zero
state. Inference is the forward under `torch.no_grad()`; training is forward and backward of a
sum. Each shape alternates the routes, keeps each route's median, and checks first that every
route's output equals the package's.

    python benches/slstm_speed.py [--threads 2] [--out benches/results/slstm_speed.json]

Needs torch, the cellc package and `xlstm` (`pip install --no-deps xlstm pyyaml packaging`).
"""
import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from xlstm.blocks.slstm.cell import sLSTMCell, sLSTMCellConfig

import cellc

CELLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cells")
HEADS = 4
# The xlstm README's embedding (128, 4 heads) and TiRex's width (512, 4 heads); T=256; B 1 and 16.
SHAPES = [(128, 1), (128, 16), (512, 1), (512, 16)]
STEPS = 256


def dense_source():
    """cells/slstm.cell with one dense [4H, H] recurrent matrix, gate-major as its input."""
    source = open(os.path.join(CELLS, "slstm.cell")).read()
    for old, new in [
        ("const HEADS = 4\n", f"const HEADS = {HEADS}\n"),
        ("param  _recurrent_kernel_[HEADS, 4*D, D]", "param  _recurrent_kernel_[4*HEADS*D, HEADS*D]"),
        ("transpose(_recurrent_kernel_ @ y, HEADS, 4)", "_recurrent_kernel_ @ y"),
    ]:
        assert old in source, old
        source = source.replace(old, new)
    return source


def routes_for(hidden):
    torch.manual_seed(0)
    config = sLSTMCellConfig(hidden_size=hidden, num_heads=HEADS, backend="vanilla", output_shape="BSH")
    ref = sLSTMCell(config)
    d = hidden // HEADS
    with torch.no_grad():
        ref._recurrent_kernel_.copy_(torch.randn_like(ref._recurrent_kernel_) / d**0.5)
        ref._bias_.copy_(torch.randn_like(ref._bias_) * 0.5)
    kernel, bias = ref._recurrent_kernel_.detach(), ref._bias_.detach()
    heads = cellc.RNN("slstm", 4 * hidden, {"D": d}, batch_first=True)
    heads.load_state_dict({"_recurrent_kernel__l0": kernel.clone(), "_bias__l0": bias.clone()})
    dense_kernel = torch.zeros(4, HEADS, d, HEADS, d)
    for k in range(HEADS):
        dense_kernel[:, k, :, k, :] = kernel[k].reshape(4, d, d)
    path = os.path.join(tempfile.gettempdir(), f"slstm_dense_{os.getpid()}.cell")
    with open(path, "w") as f:
        f.write(dense_source())
    dense = cellc.RNN(path, 4 * hidden, {"D": d}, batch_first=True)
    dense.load_state_dict({"_recurrent_kernel__l0": dense_kernel.reshape(4 * hidden, hidden), "_bias__l0": bias.clone()})
    return {"xlstm vanilla": ref, "cellc heads": heads, "cellc dense": dense}


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
        modules = routes_for(hidden)
        x = torch.randn(batch, STEPS, 4 * hidden)
        with torch.no_grad():
            want = modules["xlstm vanilla"](x)[0]
            err = {name: (m(x)[0] - want).abs().max().item() for name, m in modules.items()}
        assert max(err.values()) < 1e-4, f"H={hidden} B={batch}: outputs differ from xlstm by {err}"
        for mode in ("infer", "train"):
            runs = {name: route(m, mode == "train") for name, m in modules.items()}
            times = {name: [] for name in runs}
            for run in runs.values():
                run(x)  # warm-up (cellc compiles its kernels here)
            for _ in range(args.repeats):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run(x)
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            row = {"hidden": hidden, "heads": HEADS, "batch": batch, "steps": STEPS, "mode": mode,
                   "xlstm_vanilla_ms": med["xlstm vanilla"], "cellc_heads_ms": med["cellc heads"],
                   "cellc_dense_ms": med["cellc dense"],
                   "speedup_vs_vanilla": med["xlstm vanilla"] / med["cellc heads"],
                   "speedup_vs_dense": med["cellc dense"] / med["cellc heads"],
                   "max_abs_output_diff": max(err["cellc heads"], err["cellc dense"])}
            rows.append(row)
            print(f"H={hidden:4d} heads={HEADS} B={batch:2d} T={STEPS} {mode:5s}: "
                  f"xlstm vanilla {row['xlstm_vanilla_ms']:9.1f} ms  cellc dense {row['cellc_dense_ms']:8.2f} ms  "
                  f"cellc heads {row['cellc_heads_ms']:8.2f} ms  x{row['speedup_vs_vanilla']:.1f} vs vanilla, "
                  f"x{row['speedup_vs_dense']:.2f} vs dense  (outputs within {row['max_abs_output_diff']:.1e})")
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
