#!/usr/bin/env python3
"""Exported models against the module they came from: a module with `cellc.RNN('lstm')`
exported two ways, the AOTInductor package (its generated code calls cellc's C shim) and an
ONNX Runtime session (the `cellc::RNN` node, run by cellc's custom-operator library), against
the same module in eager mode (cellc.RNN's own time); and, for reference, PyTorch's eager
`nn.LSTM` and ONNX Runtime's own `LSTM` operator (nn.LSTM exported by the TorchScript-based
exporter, which writes one). Same run, alternating, inference, CPU; ONNX Runtime on the same
number of threads.

    python benches/export_speed.py [--batches 1 16] [--hidden 256] [--steps 100] [--threads 2]
                                   [--json benches/results/export_speed.json]

Each row alternates them, twice, and keeps each one's faster median. Ratios above 1: the
exported model is slower than eager cellc (the target is at most 1.1).
"""
import argparse
import datetime
import json
import os
import sys
import tempfile

import numpy as np
import onnxruntime as ort
import torch

import cellc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_pytorch import time_it  # noqa: E402
from peak import cpu_name  # noqa: E402


class Wrapped(torch.nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out, (h, c) = self.rnn(x)
        return out, h, c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, t = args.hidden, args.steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for b in args.batches:
            torch.manual_seed(0)
            lstm = torch.nn.LSTM(h, h, batch_first=True).eval()
            model = Wrapped(cellc.RNN("lstm", h, h, batch_first=True)).eval()
            model.rnn.load_state_dict(lstm.state_dict())
            x = torch.randn(b, t, h)
            ep = torch.export.export(model, (x,))
            package = torch._inductor.aoti_load_package(
                torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, f"lstm_b{b}.pt2")))
            diff = max((p - q).abs().max().item() for p, q in zip(package(x), model(x)))
            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            options.register_custom_ops_library(cellc.onnx_library())
            onnx_path = os.path.join(tmp, f"lstm_b{b}.onnx")
            torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(onnx_path)
            node = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
            feed = {node.get_inputs()[0].name: x.numpy()}
            diff = max(diff, max(np.abs(p - q.numpy()).max() for p, q in zip(node.run(None, feed), model(x))))
            vendor_path = os.path.join(tmp, f"nn_lstm_b{b}.onnx")
            torch.onnx.export(Wrapped(lstm), (x,), vendor_path, dynamo=False, input_names=["x"])
            vendor_options = ort.SessionOptions()
            vendor_options.intra_op_num_threads = args.threads
            vendor = ort.InferenceSession(vendor_path, vendor_options, providers=["CPUExecutionProvider"])
            runs = {"package": lambda: package(x), "onnx_node": lambda: node.run(None, feed), "cellc": lambda: model(x),
                    "nn.LSTM": lambda: lstm(x), "ort_lstm": lambda: vendor.run(None, {"x": x.numpy()})}
            best = {name: float("inf") for name in runs}
            for _ in range(2):
                for name, fn in runs.items():
                    best[name] = min(best[name], time_it(fn, args.min_time))
            row = {"batch": b, "hidden": h, "steps": t, "threads": args.threads, "max_abs_diff": diff,
                   **{f"{k}_ms": v * 1e3 for k, v in best.items()},
                   "package_over_cellc": best["package"] / best["cellc"],
                   "onnx_node_over_cellc": best["onnx_node"] / best["cellc"],
                   "nn_lstm_over_package": best["nn.LSTM"] / best["package"],
                   "ort_lstm_over_onnx_node": best["ort_lstm"] / best["onnx_node"]}
            rows.append(row)
            print(f"B={b:3d} H={h} T={t}: cellc {row['cellc_ms']:.3f} ms; package {row['package_ms']:.3f} ms "
                  f"({row['package_over_cellc']:.3f}x); ONNX node {row['onnx_node_ms']:.3f} ms "
                  f"({row['onnx_node_over_cellc']:.3f}x); nn.LSTM {row['nn.LSTM_ms']:.3f} ms; ORT LSTM "
                  f"{row['ort_lstm_ms']:.3f} ms; max |diff| {diff:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "cellc": cellc.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
