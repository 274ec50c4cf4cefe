#!/usr/bin/env python3
"""cellc.RNN against nn.LSTM / nn.GRU where PyTorch users call it: from Python, same run, alternating.

    python benches/python_vs_nn.py [--cells lstm gru] [--quick] [--json benches/results/python_vs_nn.json]
    python benches/python_vs_nn.py --shape 64 256 --layers 2 --dropout 0.3 --threads 2   # nn.LSTM(dropout=)
    python3 docs/gen_perf.py   # the book's tables, from the --json files in benches/results/

Needs a Python with torch and the cellc package (`pip install ./runtime/python`), and a release
build of the CLI (`cargo build --release`) for `cellc bench`, the runtime alone. Times:

- **varlen**: T=100, lengths uniform in [T/2, T] (unsorted), B in {1, 16, 64}, H in {128, 256,
  512}, I=H: cellc.RNN on the padded batch with its lengths, against nn.LSTM/nn.GRU's faster
  route: the padded batch as it is (oneDNN, computing the padding too) or a PackedSequence;
- **full**: every sequence at full length, T=35 and T=100 (no padding for PyTorch to waste);
- **generate**: one step per call (B=1, T=1, H=256, the state carried), as a generation loop,
  also inside `RNN.frozen()` (the weights packed once for the loop);
- **fixed cost**: B=1, T=4, H=64 inference, cellc.RNN against `cellc bench` at the same shape.

Inference runs under no_grad, training is forward + backward of out.sum(); 1 and 2 threads
(torch.set_num_threads). Each measurement alternates cellc, PyTorch, cellc, PyTorch and keeps
each one's faster median. Ratios are PyTorch time / cellc time: above 1, cellc is faster.
Each cellc row also gives its matrix products' rate as a fraction of this machine's f32 FMA
peak at that thread count, measured first (`cellc peak`).
"""
import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_pytorch import CELLC, cellc_time, lengths_uniform, time_it  # noqa: E402
from peak import cpu_name  # noqa: E402

import cellc  # noqa: E402

TORCH = {"lstm": nn.LSTM, "gru": nn.GRU}


def pair(cell, b, t, h, lengths, device="cpu", stack=(1, 0.0)):
    """nn.LSTM/nn.GRU and cellc.RNN with the same weights, on `device`; `stack`: layers and
    the dropout between them (training mode, as modules are made: both draw masks)."""
    layers, dropout = stack
    mod = TORCH[cell](h, h, num_layers=layers, dropout=dropout, batch_first=True)
    rnn = cellc.RNN(cell, h, h, num_layers=layers, dropout=dropout, batch_first=True)
    rnn.load_state_dict(mod.state_dict())
    return mod.to(device), rnn.to(device)


def step(fn, mode, x):
    if mode == "infer":
        with torch.no_grad():
            fn()
    else:
        out = fn()
        out.sum().backward()
        x.grad = None


def times(cell, b, t, h, mode, lengths, min_time, device="cpu", stack=(1, 0.0)):
    """Seconds per call: cellc.RNN, nn's padded route, nn's packed route (None at full length).
    On "cuda" every tensor lives on the GPU (the lengths stay on the host, as PyTorch keeps them)."""
    mod, rnn = pair(cell, b, t, h, lengths, device, stack)
    x = torch.randn(b, t, h, device=device, requires_grad=(mode == "train"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    full = all(n == t for n in lengths)
    lengths_t = torch.tensor(lengths)

    def cellc_call():
        return rnn(x, lengths=None if full else lengths_t)[0]

    def padded():
        return mod(x)[0]

    def packed():
        p = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return mod(p)[0].data

    fns = {"cellc": cellc_call, "padded": padded}
    if not full:
        fns["packed"] = packed
    best = {}
    for _ in range(2):
        for name, fn in fns.items():
            s = time_it(lambda: step(fn, mode, x), min_time, sync)
            best[name] = min(best.get(name, s), s)
    return best


# Matrix-product flops per valid step and unit of H², one layer, I = H: the LSTM's two [4H, H]
# products forwards (2 flops per multiply-add), the GRU's two [3H, H]; training adds the
# backward's four products (the inputs' and the states' adjoints, the two weight gradients).
FLOPS_PER_H2 = {"lstm": 16, "gru": 12}


def product_flops(cell, h, tokens, mode, layers=1):
    """The matrix products' flops of a call over `tokens` valid steps."""
    forward = FLOPS_PER_H2[cell] * h * h * tokens * layers
    return forward * (3 if mode == "train" else 1)


def machine_peaks(threads):
    """This machine's f32 FMA peak in GFLOP/s at each thread count (`cellc peak`)."""
    cmd = [CELLC, "peak", "--json", "--min-time", "0.5"] + [a for t in threads for a in ("--threads", str(t))]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    peaks = json.loads(done.stdout)["peaks"]
    return {p["threads"]: p["gflops"] for p in peaks if p["kind"] == "f32_fma"}


def generate_time(cell, h, words, threads):
    """Seconds per step of a loop that feeds one step per call, carrying the state: cellc.RNN
    as it is, inside `RNN.frozen()` (its weights packed once for the loop), and PyTorch."""
    mod, rnn = pair(cell, 1, 1, h, [1])
    x = torch.randn(1, 1, h)
    result = {}
    with torch.no_grad():
        for _ in range(2):
            for name, fn in (("cellc", rnn), ("frozen", rnn), ("nn", mod)):
                with rnn.frozen() if name == "frozen" else contextlib.nullcontext():
                    state = None
                    for _ in range(20):
                        _, state = fn(x, state)
                    start = time.perf_counter()
                    for _ in range(words):
                        _, state = fn(x, state)
                    s = (time.perf_counter() - start) / words
                result[name] = min(result.get(name, s), s)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["lstm", "gru"], choices=sorted(TORCH))
    ap.add_argument("--quick", action="store_true", help="B=16, H=256 only")
    ap.add_argument("--min-time", type=float, default=0.4)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--json", help="write all measurements here")
    ap.add_argument("--layers", type=int, default=1, help="layers of both models")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout between layers (both in training mode)")
    ap.add_argument("--shape", nargs=2, type=int, metavar=("B", "H"),
                    help="this batch and size only, lengths varying (T=100), no other measurement")
    args = ap.parse_args()
    batches, hiddens = ([16], [256]) if args.quick else ([1, 16, 64], [128, 256, 512])
    if args.shape:
        batches, hiddens = [args.shape[0]], [args.shape[1]]
    stack = (args.layers, args.dropout)
    rows = []
    meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "threading": cellc.threading(),
            "layers": args.layers, "dropout": args.dropout}
    peaks = machine_peaks(args.threads)
    meta["f32_fma_peak_gflops"] = peaks
    print(meta, flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for cell in args.cells:
            for mode in ("infer", "train"):
                configs = [("varlen", 100, b, h) for b in batches for h in hiddens]
                if not args.shape:
                    configs += [("full", t, b, h) for t in (35, 100) for b in batches for h in hiddens]
                for kind, t, b, h in configs:
                    lengths = lengths_uniform(b, t) if kind == "varlen" else [t] * b
                    s = times(cell, b, t, h, mode, lengths, args.min_time, stack=stack)
                    nn_best = min(v for k, v in s.items() if k != "cellc")
                    gflops = product_flops(cell, h, sum(lengths), mode, args.layers) / s["cellc"] / 1e9
                    row = dict(kind=kind, cell=cell, mode=mode, threads=threads, batch=b, hidden=h, steps=t,
                               cellc_s=s["cellc"], nn_padded_s=s["padded"], nn_packed_s=s.get("packed"),
                               ratio=nn_best / s["cellc"], cellc_gflops=gflops,
                               peak_fraction=gflops / peaks[threads])
                    rows.append(row)
                    print(f"{kind:<7}{cell:<5}{mode:<6}{threads}t B={b:<3} T={t:<4} H={h:<4} cellc "
                          f"{s['cellc'] * 1e3:8.3f} ms ({row['peak_fraction']:4.0%} of peak)  nn padded "
                          f"{s['padded'] * 1e3:8.3f}  packed {(s.get('packed') or float('nan')) * 1e3:8.3f}  "
                          f"ratio {row['ratio']:.2f}", flush=True)
            if args.shape:
                continue
            g = generate_time(cell, 256, 2000, threads)
            rows.append(dict(kind="generate", cell=cell, mode="infer", threads=threads, batch=1, hidden=256, steps=1,
                             cellc_s=g["cellc"], frozen_s=g["frozen"], nn_s=g["nn"], ratio=g["nn"] / g["cellc"],
                             frozen_ratio=g["nn"] / g["frozen"]))
            print(f"generate {cell} {threads}t B=1 T=1 H=256: cellc {g['cellc'] * 1e6:.1f} us/step (frozen "
                  f"{g['frozen'] * 1e6:.1f}), nn {g['nn'] * 1e6:.1f}, ratio {g['nn'] / g['cellc']:.2f} (frozen "
                  f"{g['nn'] / g['frozen']:.2f})", flush=True)
        if args.shape:
            continue
        # The Python layer's fixed cost over the runtime alone.
        rnn = cellc.RNN("lstm", 64, 64, batch_first=True)
        x = torch.randn(1, 4, 64)
        with torch.no_grad():
            module = min(time_it(lambda: rnn(x), args.min_time) for _ in range(2))
        bench = min(cellc_time("lstm", 1, 4, 64, threads, "infer", args.min_time, lengths="full")
                    ["median_s"] for _ in range(2))
        rows.append(dict(kind="fixed", cell="lstm", mode="infer", threads=threads, batch=1, hidden=64, steps=4,
                         cellc_s=module, bench_s=bench, overhead_us=(module - bench) * 1e6))
        print(f"fixed cost {threads}t B=1 T=4 H=64: cellc.RNN {module * 1e6:.1f} us, cellc bench "
              f"{bench * 1e6:.1f} us, Python layer {(module - bench) * 1e6:.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
