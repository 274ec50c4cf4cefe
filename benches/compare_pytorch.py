#!/usr/bin/env python3
"""cellc against PyTorch on this machine, in the same run, alternating.

    python benches/compare_pytorch.py [--cells lstm gru layernorm_lstm sru mingru] [--quick] [--plot ratios.png]

Needs a Python with torch (e.g. a virtualenv made by the shared setup-torch-cpu.sh; never a CI
dependency) and a release build of cellc (`cargo build --release`). For every shape it times
`cellc bench --json` and the PyTorch equivalent back to back, with the same thread count:

- lstm, gru: torch.nn.LSTM / nn.GRU by both of PyTorch's routes for variable lengths, under
  no_grad for inference, forward + backward for training: the padded batch as it is (oneDNN's
  fused LSTM on the CPU, computing the padding too) and a PackedSequence (pack_padded_sequence
  of the same uniform lengths). The ratio is taken to the faster route; both are reported;
- custom cells (layernorm_lstm, sru, mingru): the TorchScript and the plain Python-loop versions, as
  PyTorch's benchmarks/fastrnns does (padded input, each sequence's steps up to its length);
  layernorm_lstm also against nn.LSTM at the same shape (its faster route): a custom cell should
  not lose the vendor's speed.

Shapes: T=100, I=H, lengths uniform in [T/2, T], B in {1, 16, 64}, H in {128, 256, 512},
1 and 2 threads, inference and training. Prints a table of ratios (PyTorch time / cellc time:
above 1 means cellc is faster) and writes JSON next to the plot if asked.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Tuple

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLC = os.path.join(ROOT, "target", "release", "cellc")


def lengths_uniform(b, t, seed=0x5EED):
    """The same lengths as `cellc bench --lengths uniform` (SplitMix64, same seed)."""
    mask = (1 << 64) - 1
    state = seed
    out = []
    lo = max(t // 2, 1)
    for _ in range(b):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(lo + z % (t - lo + 1))
    return out


def time_it(fn, min_time, sync=lambda: None):
    """Median wall time of fn(); `sync` waits for queued GPU work."""
    fn()  # warm-up
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cellc_time(cell, b, t, h, threads, mode, min_time, backend="cpu", extra=(), lengths="uniform"):
    cmd = [CELLC, "bench", os.path.join(ROOT, "cells", f"{cell}.cell"), "-D", f"H={h}", "-D", f"I={h}",
           "--batch", str(b), "--steps", str(t), "--lengths", lengths, "--mode", mode,
           "--min-time", str(min_time), "--json", "--backend", backend]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += list(extra)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


class LayerNormLSTMCell(nn.Module):
    """As benchmarks/fastrnns/custom_lstms.py: LayerNorm on both projections and on c."""

    def __init__(self, i, h):
        super().__init__()
        self.hidden, self.n_states = h, 2
        self.weight_ih = nn.Parameter(torch.randn(4 * h, i) * 0.05)
        self.weight_hh = nn.Parameter(torch.randn(4 * h, h) * 0.05)
        self.layernorm_i = nn.LayerNorm(4 * h)
        self.layernorm_h = nn.LayerNorm(4 * h)
        self.layernorm_c = nn.LayerNorm(h)

    def forward(self, x: torch.Tensor, state: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        hx, cx = state
        igates = self.layernorm_i(torch.mm(x, self.weight_ih.t()))
        hgates = self.layernorm_h(torch.mm(hx, self.weight_hh.t()))
        i, f, g, o = (igates + hgates).chunk(4, 1)
        cy = self.layernorm_c(torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g))
        hy = torch.sigmoid(o) * torch.tanh(cy)
        return hy, (hy, cy)


class SRUCell(nn.Module):
    """cells/sru.cell: the highway SRU (Lei et al. 2018), one state c."""

    def __init__(self, i, h):
        super().__init__()
        self.hidden, self.n_states = h, 1
        self.weight_ih = nn.Parameter(torch.randn(3 * h, h) * 0.05)
        self.v_f = nn.Parameter(torch.randn(h) * 0.05)
        self.v_r = nn.Parameter(torch.randn(h) * 0.05)
        self.bias_f = nn.Parameter(torch.zeros(h))
        self.bias_r = nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor, state: Tuple[torch.Tensor]) -> Tuple[torch.Tensor, Tuple[torch.Tensor]]:
        c = state[0]
        xt, fx, rx = torch.mm(x, self.weight_ih.t()).chunk(3, 1)
        f = torch.sigmoid(fx + self.v_f * c + self.bias_f)
        r = torch.sigmoid(rx + self.v_r * c + self.bias_r)
        c2 = f * c + (1 - f) * xt
        return r * c2 + (1 - r) * x, (c2,)


class MinGRUCell(nn.Module):
    """cells/mingru.cell: minGRU (Feng et al. 2024), sequential form."""

    def __init__(self, i, h):
        super().__init__()
        self.hidden, self.n_states = h, 1
        self.weight_z = nn.Parameter(torch.randn(h, i) * 0.05)
        self.bias_z = nn.Parameter(torch.zeros(h))
        self.weight_h = nn.Parameter(torch.randn(h, i) * 0.05)
        self.bias_h = nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor, state: Tuple[torch.Tensor]) -> Tuple[torch.Tensor, Tuple[torch.Tensor]]:
        h = state[0]
        z = torch.sigmoid(nn.functional.linear(x, self.weight_z, self.bias_z))
        ht = nn.functional.linear(x, self.weight_h, self.bias_h)
        h2 = (1 - z) * h + z * ht
        return h2, (h2,)


CUSTOM = {"layernorm_lstm": LayerNormLSTMCell, "sru": SRUCell, "mingru": MinGRUCell}


def loop_over_time(cell, x, lengths):
    """A plain loop over time; finished sequences keep their state (masking)."""
    b, t, _ = x.shape
    state = tuple(x.new_zeros(b, cell.hidden) for _ in range(cell.n_states))
    mask = (torch.arange(t, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]).float().unsqueeze(-1)
    outs = []
    for s in range(t):
        y, new = cell(x[:, s], state)
        m = mask[:, s]
        state = tuple(m * n + (1 - m) * o for n, o in zip(new, state))
        outs.append(y * m)
    return torch.stack(outs, 1)


def torch_time(cell, b, t, h, mode, variant, min_time, device="cpu"):
    """Seconds per call. lstm/gru variants: "padded" (the padded batch as it is) or "packed"."""
    lengths = lengths_uniform(b, t)
    x = torch.randn(b, t, h, device=device, requires_grad=(mode == "train"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if cell in ("lstm", "gru"):
        mod = (nn.LSTM if cell == "lstm" else nn.GRU)(h, h, batch_first=True).to(device)

        def batch():
            if variant == "padded":
                return x
            return nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)

        def run():
            if mode == "infer":
                with torch.no_grad():
                    mod(batch())
            else:
                out, _ = mod(batch())
                (out if variant == "padded" else out.data).sum().backward()
        return time_it(run, min_time, sync)
    if cell in CUSTOM:
        c = CUSTOM[cell](h, h).to(device)
        if variant == "torchscript":
            c = torch.jit.script(c)

        def run():
            if mode == "infer":
                with torch.no_grad():
                    loop_over_time(c, x, lengths)
            else:
                loop_over_time(c, x, lengths).sum().backward()
        return time_it(run, min_time, sync)
    raise ValueError(f"no PyTorch version of {cell}")


def add_grid_arguments(ap):
    """The options of the shape grid, shared by the comparison scripts."""
    ap.add_argument("--quick", action="store_true", help="B=16, H=256 only, 0.3 s per measurement")
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--batches", nargs="+", type=int, help="batch sizes (default 1 16 64)")
    ap.add_argument("--hiddens", nargs="+", type=int, help="hidden sizes (default 128 256 512)")
    ap.add_argument("--modes", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--json", help="write all measurements here")


def grid(args):
    """(batch sizes, hidden sizes, seconds per measurement) the options select; needs the CLI built."""
    if not os.path.exists(CELLC):
        sys.exit("build cellc first: cargo build --release")
    batches, hiddens = ([16], [256]) if args.quick else ([1, 16, 64], [128, 256, 512])
    return args.batches or batches, args.hiddens or hiddens, 0.3 if args.quick else args.min_time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["lstm", "gru", "layernorm_lstm", "sru", "mingru"])
    ap.add_argument("--plot", help="write a bar chart of the ratios (needs matplotlib)")
    add_grid_arguments(ap)
    args = ap.parse_args()
    batches, hiddens, min_time = grid(args)
    t = 100
    rows = []
    print(f"torch {torch.__version__}, T={t}, I=H, lengths uniform in [T/2, T]; ratio = torch / cellc (> 1: cellc faster)")
    print("GF/s: cellc's matrix-product rate; gemm%: that rate over the same products timed alone (inference)")
    print(f"{'cell':<16}{'mode':<7}{'thr':>4}{'B':>5}{'H':>5}  {'cellc ms':>10}{'GF/s':>8}{'gemm%':>7}  {'torch variant':<14}{'torch ms':>10}{'ratio':>8}")
    for cell in args.cells:
        # lstm, gru: both of PyTorch's routes, the ratio to the faster; custom cells: TorchScript and a loop.
        # layernorm_lstm is also held against nn.LSTM itself: a custom cell should not lose the vendor's speed.
        routes_of = lambda torch_cell: (("padded", torch_cell, "padded"), ("packed", torch_cell, "packed"))
        variants = [("nn", routes_of(cell))] if cell in ("lstm", "gru") else [
            ("torchscript", (("torchscript", cell, "torchscript"),)), ("loop", (("loop", cell, "loop"),))]
        if cell == "layernorm_lstm":
            variants.append(("nn.LSTM", routes_of("lstm")))
        for mode in args.modes:
            for threads in args.threads:
                torch.set_num_threads(threads)
                for b in batches:
                    for h in hiddens:
                        for variant, routes in variants:
                            # Alternate: cellc, each torch route, cellc again; keep the better cellc.
                            c1 = cellc_time(cell, b, t, h, threads, mode, min_time)
                            times = {name: torch_time(tc, b, t, h, mode, route, min_time) for name, tc, route in routes}
                            c2 = cellc_time(cell, b, t, h, threads, mode, min_time)
                            best = min((c1, c2), key=lambda r: r["median_s"])
                            c = best["median_s"]
                            pt = min(times.values())
                            # Inference: the share of the GEMM-only rate on the same products.
                            frac = best.get("gemm_fraction")
                            rows.append(dict(cell=cell, mode=mode, threads=threads, batch=b, hidden=h,
                                             variant=variant, cellc_s=c, torch_s=pt, ratio=pt / c,
                                             routes={r: dict(torch_s=v, ratio=v / c) for r, v in times.items()},
                                             gemm_fraction=frac,
                                             cellc_gflops=best["gflops"], gemm_only_gflops=best.get("gemm_only_gflops")))
                            share = f"{100 * frac:>6.0f}%" if frac is not None else f"{'':>7}"
                            label = variant if len(routes) == 1 else variant + " best"
                            each = "  (" + ", ".join(f"{r} {v * 1e3:.3f} ms: {v / c:.2f}" for r, v in times.items()) + ")" if len(routes) > 1 else ""
                            print(f"{cell:<16}{mode:<7}{threads:>4}{b:>5}{h:>5}  {c * 1e3:>10.3f}{best['gflops']:>8.1f}{share}  {label:<14}{pt * 1e3:>10.3f}{pt / c:>8.2f}{each}",
                                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            sys.exit("--plot needs matplotlib in this Python")
        labels = [f"{r['cell']} {r['mode']} {r['variant']}\nt{r['threads']} B{r['batch']} H{r['hidden']}" for r in rows]
        fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.35), 5))
        ax.bar(range(len(rows)), [r["ratio"] for r in rows])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_ylabel("PyTorch time / cellc time")
        ax.set_yscale("log")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
