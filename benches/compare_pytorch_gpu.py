#!/usr/bin/env python3
"""cellc's CUDA back end against PyTorch on a GPU, in the same run, alternating.

    python benches/compare_pytorch_gpu.py [--cells lstm gru layernorm_lstm sru mingru] [--cuda-graphs] [--json out.json]

For a machine with an NVIDIA GPU, torch built with CUDA and a release build of cellc
(`cargo build --release`; NVRTC and the driver are loaded at run time). The same shapes as
`compare_pytorch.py` (T=100, I=H, lengths uniform in [T/2, T], B in {1, 16, 64}, H in
{128, 256, 512}, inference and training), against `nn.LSTM`/`nn.GRU` by both routes, the padded
batch and a PackedSequence (cuDNN), and against TorchScript and plain-loop custom cells on the GPU. Prints PyTorch time /
cellc time per shape (`--cuda-graphs`: cellc runs each layer as a CUDA graph, captured at the
first timed run and relaunched after it); where `cellc bench --backend cuda` fails (no driver, no device, or a
back end that cannot run yet) the row says why instead of a ratio.
"""
import argparse
import json
import subprocess
import sys

import torch

import compare_pytorch as cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["lstm", "gru", "layernorm_lstm", "sru", "mingru"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--hiddens", nargs="+", type=int, default=[128, 256, 512])
    ap.add_argument("--modes", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--cuda-graphs", action="store_true", help="cellc bench --cuda-graphs")
    ap.add_argument("--json", help="write all measurements here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch: this script is for a GPU machine")
    t = 100
    rows = []
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, T={t}, I=H; ratio = torch / cellc")
    print(f"{'cell':<16}{'mode':<7}{'B':>5}{'H':>5}  {'cellc ms':>10}  {'torch variant':<14}{'torch ms':>10}{'ratio':>8}")
    for cell in args.cells:
        variants = ["padded", "packed"] if cell in ("lstm", "gru") else ["torchscript", "loop"]
        for mode in args.modes:
            for b in args.batches:
                for h in args.hiddens:
                    for variant in variants:
                        try:
                            c = cpu.cellc_time(cell, b, t, h, None, mode, args.min_time, backend="cuda",
                                           extra=["--cuda-graphs"] if args.cuda_graphs else [])["median_s"]
                        except subprocess.CalledProcessError as e:
                            c, why = None, (e.stderr or "").strip().splitlines()[-1:] or ["failed"]
                        pt = cpu.torch_time(cell, b, t, h, mode, variant, args.min_time, device="cuda")
                        row = dict(cell=cell, mode=mode, batch=b, hidden=h, variant=variant,
                                   cellc_s=c, torch_s=pt, ratio=(pt / c) if c else None)
                        rows.append(row)
                        shown = f"{c * 1e3:>10.3f}" if c else f"{'-':>10}"
                        ratio = f"{pt / c:>8.2f}" if c else f"  cellc: {why[0]}"
                        print(f"{cell:<16}{mode:<7}{b:>5}{h:>5}  {shown}  {variant:<14}{pt * 1e3:>10.3f}{ratio}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
