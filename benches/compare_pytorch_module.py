#!/usr/bin/env python3
"""cellc.RNN (the Python package) against PyTorch, from Python, in the same run, alternating.

    python benches/compare_pytorch_module.py [--cells lstm layernorm_lstm] [--quick] [--json out.json]

Needs a Python with torch and the cellc package (`pip install ./runtime/python`), and a release
build of the CLI (`cargo build --release`) for the per-call overhead against `cellc bench`.
At the CPU comparison's shapes (benches/compare_pytorch.py: T=100, I=H, lengths uniform in
[T/2, T], B in {1, 16, 64}, H in {128, 256, 512}, 1 and 2 threads, inference under no_grad and
training as forward + backward of out.sum()), it times:

- cellc.RNN on the padded batch with its lengths (no packing);
- lstm: nn.LSTM by both routes (the padded batch as it is, oneDNN; a PackedSequence), ratio to
  the faster; layernorm_lstm: nn.LSTM too (a custom cell should not lose the vendor's speed);
- the same cell as a TorchScript cell and as an eager Python loop over time;
- `cellc bench` at the same shape: the Rust runtime alone. The Python layer's per-call overhead
  is cellc.RNN's time minus that (also on a tiny shape, where the fixed cost shows).

Ratios are PyTorch time / cellc.RNN time: above 1, cellc is faster.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_pytorch import (  # noqa: E402
    CUSTOM, add_grid_arguments, cellc_time, grid, lengths_uniform, loop_over_time, time_it, torch_time)

import cellc  # noqa: E402


class LSTMLoopCell(nn.Module):
    """nn.LSTM's step as a cell for a loop over time (scriptable), as benchmarks/fastrnns does."""

    def __init__(self, i, h):
        super().__init__()
        self.hidden, self.n_states = h, 2
        self.weight_ih = nn.Parameter(torch.randn(4 * h, i) * 0.05)
        self.weight_hh = nn.Parameter(torch.randn(4 * h, h) * 0.05)
        self.bias = nn.Parameter(torch.zeros(4 * h))

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        hx, cx = state
        gates = torch.addmm(self.bias, x, self.weight_ih.t()) + torch.mm(hx, self.weight_hh.t())
        i, f, g, o = gates.chunk(4, 1)
        cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
        hy = torch.sigmoid(o) * torch.tanh(cy)
        return hy, (hy, cy)


LOOP_CELLS = {"lstm": LSTMLoopCell, **CUSTOM}


def module_time(cell, b, t, h, mode, min_time):
    """Seconds per call of cellc.RNN on the padded batch with its lengths."""
    rnn = cellc.RNN(cell, h, {"H": h}, batch_first=True)
    x = torch.randn(b, t, h, requires_grad=(mode == "train"))
    lengths = torch.tensor(lengths_uniform(b, t))

    def run():
        if mode == "infer":
            with torch.no_grad():
                rnn(x, lengths=lengths)
        else:
            out, _ = rnn(x, lengths=lengths)
            out.sum().backward()

    return time_it(run, min_time)


def loop_time(cell, b, t, h, mode, script, min_time):
    c = LOOP_CELLS[cell](h, h)
    if script:
        c = torch.jit.script(c)
    x = torch.randn(b, t, h, requires_grad=(mode == "train"))
    lengths = lengths_uniform(b, t)

    def run():
        if mode == "infer":
            with torch.no_grad():
                loop_over_time(c, x, lengths)
        else:
            loop_over_time(c, x, lengths).sum().backward()

    return time_it(run, min_time)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["lstm", "layernorm_lstm"], choices=sorted(LOOP_CELLS))
    add_grid_arguments(ap)
    args = ap.parse_args()
    batches, hiddens, min_time = grid(args)
    t = 100
    rows = []
    print(f"torch {torch.__version__}, T={t}, I=H, lengths uniform in [T/2, T]; ratio = torch / cellc.RNN (> 1: cellc faster)")
    print(f"{'cell':<16}{'mode':<7}{'thr':>4}{'B':>5}{'H':>5}{'cellc.RNN ms':>14}{'bench ms':>10}{'py µs':>8}"
          f"{'nn.LSTM':>10}{'script':>10}{'loop':>10}")
    for mode in args.modes:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for cell in args.cells:
                for b in batches:
                    for h in hiddens:
                        # Alternate: cellc.RNN, the Rust runtime alone, PyTorch, cellc.RNN again.
                        m1 = module_time(cell, b, t, h, mode, min_time)
                        bench = cellc_time(cell, b, t, h, threads, mode, min_time)["median_s"]
                        nn_routes = {}
                        if cell in ("lstm", "layernorm_lstm"):
                            nn_routes = {r: torch_time("lstm", b, t, h, mode, r, min_time) for r in ("padded", "packed")}
                        script = loop_time(cell, b, t, h, mode, True, min_time)
                        loop = loop_time(cell, b, t, h, mode, False, min_time)
                        m2 = module_time(cell, b, t, h, mode, min_time)
                        m = min(m1, m2)
                        row = dict(cell=cell, mode=mode, threads=threads, batch=b, hidden=h, module_s=m, bench_s=bench,
                                   overhead_us=(m - bench) * 1e6, nn_routes=nn_routes,
                                   nn_ratio=min(nn_routes.values()) / m if nn_routes else None,
                                   torchscript_ratio=script / m, loop_ratio=loop / m)
                        rows.append(row)
                        nn_text = f"{row['nn_ratio']:>10.2f}" if nn_routes else f"{'':>10}"
                        print(f"{cell:<16}{mode:<7}{threads:>4}{b:>5}{h:>5}{m * 1e3:>14.3f}{bench * 1e3:>10.3f}"
                              f"{row['overhead_us']:>8.0f}{nn_text}{row['torchscript_ratio']:>10.2f}{row['loop_ratio']:>10.2f}",
                              flush=True)
    # The fixed cost of a call: a tiny shape, inference.
    for threads in args.threads:
        torch.set_num_threads(threads)
        m = min(module_time("lstm", 1, 4, 64, "infer", min_time) for _ in range(2))
        bench = cellc_time("lstm", 1, 4, 64, threads, "infer", min_time)["median_s"]
        rows.append(dict(cell="lstm", mode="infer", threads=threads, batch=1, hidden=64, steps=4, module_s=m,
                         bench_s=bench, overhead_us=(m - bench) * 1e6))
        print(f"per-call overhead, lstm B=1 T=4 H=64 infer, {threads} thread(s): cellc.RNN {m * 1e6:.1f} µs, "
              f"cellc bench {bench * 1e6:.1f} µs, Python layer {(m - bench) * 1e6:.1f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
