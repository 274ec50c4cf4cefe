#!/usr/bin/env python3
"""bf16 from PyTorch: cellc.RNN under torch.autocast('cpu', dtype=torch.bfloat16) against
nn.LSTM / nn.GRU under the same autocast (oneDNN's bf16 RNN, padded and packed) and both in
float32, same run, alternating.

    python benches/bf16_speed.py [--quick] [--threads 2] [--json benches/results/bf16_speed_<cpu>.json]

Shapes: B in {16, 64}, H in {256, 512}, T=100, I=H, every sequence full length, inference
(no_grad) and training (forward + backward of out.float().sum()); and layernorm_lstm (cellc
only: PyTorch has no fused LayerNorm-LSTM) against nn.LSTM's bf16 route, the vendor's speed.
Each route runs in turn, twice over, keeping its faster median. A route PyTorch cannot run on
this processor (oneDNN's bf16 RNN needs AVX512-BF16 or AMX) is recorded with its error.
"""
import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_pytorch import time_it  # noqa: E402

import cellc  # noqa: E402

TORCH = {"lstm": nn.LSTM, "gru": nn.GRU}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = sorted({w for w in info.split() if w.startswith(("avx512_bf16", "amx"))})
        return name, flags
    except (OSError, StopIteration):
        return platform.processor(), []


def run(fn, mode, x):
    if mode == "infer":
        with torch.no_grad():
            fn()
    else:
        out = fn()
        out.float().sum().backward()
        x.grad = None


def routes(cell, b, t, h):
    """name -> (callable returning the output, the input tensor)."""
    torch.manual_seed(0)
    vendor = TORCH.get(cell, nn.LSTM)(h, h, batch_first=True)
    rnn = cellc.RNN(cell, h, {"H": h}, batch_first=True)
    if cell in TORCH:
        rnn.load_state_dict(vendor.state_dict())
    x = torch.randn(b, t, h, requires_grad=True)
    lengths = torch.full((b,), t)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731

    def under(ctx, fn):
        def call():
            with ctx():
                return fn()
        return call

    nothing = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    return {
        "cellc bf16": under(bf16, lambda: rnn(x)[0]),
        "cellc f32": under(nothing, lambda: rnn(x)[0]),
        "torch bf16 padded": under(bf16, lambda: vendor(x)[0]),
        "torch bf16 packed": under(bf16, lambda: vendor(pack_padded_sequence(x, lengths, batch_first=True))[0].data),
        "torch f32 padded": under(nothing, lambda: vendor(x)[0]),
    }, x


def measure(cell, b, t, h, mode, min_time):
    fns, x = routes(cell, b, t, h)
    best, errors = {}, {}
    for _ in range(2):
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                s = time_it(lambda: run(fn, mode, x), min_time)
            except RuntimeError as e:
                errors[name] = str(e).splitlines()[0][:160]
                continue
            best[name] = min(s, best.get(name, s))
    ms = {k: round(v * 1e3, 3) for k, v in best.items()}
    torch_bf16 = [v for k, v in best.items() if k.startswith("torch bf16")]
    row = {"cell": cell, "B": b, "T": t, "H": h, "mode": mode, "ms": ms, "errors": errors}
    if torch_bf16:
        row["cellc_bf16_vs_torch_bf16_faster"] = round(min(torch_bf16) / best["cellc bf16"], 3)
    row["cellc_bf16_vs_cellc_f32"] = round(best["cellc f32"] / best["cellc bf16"], 3)
    row["cellc_bf16_vs_torch_f32"] = round(best["torch f32 padded"] / best["cellc bf16"], 3)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="B=16 H=256 only, shorter timings")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    min_time = 0.3 if args.quick else 1.0
    shapes = [(16, 256)] if args.quick else [(16, 256), (16, 512), (64, 256), (64, 512)]
    rows = []
    for cell in ("lstm", "gru", "layernorm_lstm"):
        for b, h in shapes:
            for mode in ("infer", "train"):
                row = measure(cell, b, 100, h, mode, min_time)
                print(json.dumps(row), flush=True)
                rows.append(row)
    name, flags = cpu_name()
    result = {
        "cpu": name, "cpu_bf16_flags": flags, "threads": args.threads, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "rows": rows,
    }
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
