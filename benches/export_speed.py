#!/usr/bin/env python3
"""An exported model against the module it came from: the AOTInductor package of a module
with `cellc.RNN('lstm')` (its generated code calls cellc's C shim), against the same module
in eager mode (cellc.RNN's own time), and against PyTorch's eager `nn.LSTM`; same run,
alternating, inference, CPU.

    python benches/export_speed.py [--batches 1 16] [--hidden 256] [--steps 100] [--threads 2]
                                   [--json benches/results/export_speed.json]

Each row alternates the three, twice, and keeps each one's faster median. Ratios above 1: the
package is slower than eager cellc (the target is at most 1.1).
"""
import argparse
import json
import os
import sys
import tempfile

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
            runs = {"package": lambda: package(x), "cellc": lambda: model(x), "nn.LSTM": lambda: lstm(x)}
            best = {name: float("inf") for name in runs}
            for _ in range(2):
                for name, fn in runs.items():
                    best[name] = min(best[name], time_it(fn, args.min_time))
            row = {"batch": b, "hidden": h, "steps": t, "threads": args.threads, "max_abs_diff": diff,
                   **{f"{k}_ms": v * 1e3 for k, v in best.items()},
                   "package_over_cellc": best["package"] / best["cellc"],
                   "nn_lstm_over_package": best["nn.LSTM"] / best["package"]}
            rows.append(row)
            print(f"B={b:3d} H={h} T={t}: package {row['package_ms']:.3f} ms, cellc {row['cellc_ms']:.3f} ms "
                  f"({row['package_over_cellc']:.3f}x), nn.LSTM {row['nn.LSTM_ms']:.3f} ms "
                  f"(package {row['nn_lstm_over_package']:.2f}x faster); max |diff| {diff:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "torch": torch.__version__, "cellc": cellc.__version__, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
