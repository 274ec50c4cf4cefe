#!/usr/bin/env python3
"""The main job against PyTorch: the same model, the same batches, the same steps, alternating.

    python benches/charlm_side_by_side.py [--cell lstm|gru|layernorm_lstm] [--steps 200]
                                          [--rounds 3] [--threads 2] [--json out.json]

Needs a Python with torch, and builds `charlm` itself (`cargo build --release -p cellc-examples
--example charlm`). Each round trains a fresh model for `--steps` steps twice, one after the other:

- `charlm` (the README's first command, shortened): candle-nn's embedding, head, loss and AdamW
  around cellc's RNN; it writes the batches it drew (`--write-batches`);
- PyTorch on exactly those batches: nn.Embedding(V, 64) -> RNN -> nn.Linear(H, V), cross-entropy
  over the real positions, AdamW (weight decay 0, as charlm), global-norm clipping at 1, the same
  warm-up + cosine schedule. The RNN is PyTorch's faster route here: the padded batch given to
  `nn.LSTM` / `nn.GRU` as it is (oneDNN; positions past a verse's end are computed and masked
  out of the loss, which a causal RNN allows); for layernorm_lstm, a TorchScript LayerNorm-LSTM
  cell (benchmarks/fastrnns' custom_lstms.py) in a loop over time, as `benches/compare_pytorch.py`.
  For lstm and gru, PyTorch's other route is timed too and reported: `pack_padded_sequence`
  (unsorted) through the same module and `pad_packed_sequence` back. The ratio is taken to the
  faster of the two.

Both count the characters predicted and the seconds of the training steps (batch assembly,
forward, backward, clipping and the optimiser step; validation excluded). Prints each round,
the medians and their ratio (charlm / PyTorch tokens/s: above 1, charlm is faster).
"""
import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "pytorch"))
from compare_pytorch import LayerNormLSTMCell, loop_over_time  # noqa: E402
from train_export import DATA, load_corpus, lr_at  # noqa: E402

CHARLM = os.path.join(ROOT, "target", "release", "examples", "charlm")


class TorchLM(nn.Module):
    """charlm's model in PyTorch, over padded batch-first batches."""

    def __init__(self, cell, vocab, embedding, hidden, packed=False):
        super().__init__()
        self.packed = packed
        self.embedding = nn.Embedding(vocab, embedding)
        if cell == "lstm":
            self.rnn = nn.LSTM(embedding, hidden, batch_first=True)
        elif cell == "gru":
            self.rnn = nn.GRU(embedding, hidden, batch_first=True)
        elif cell == "layernorm_lstm":
            self.rnn = torch.jit.script(LayerNormLSTMCell(embedding, hidden))
        else:
            raise ValueError(f"no PyTorch model for --cell {cell}")
        self.scripted = cell == "layernorm_lstm"
        self.head = nn.Linear(hidden, vocab)

    def forward(self, inputs, lengths):
        x = self.embedding(inputs)
        if self.scripted:
            out = loop_over_time(self.rnn, x, lengths)
        elif self.packed:
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True,
                                                   total_length=x.shape[1])[0]
        else:
            out = self.rnn(x)[0]
        return self.head(out)


def torch_round(cell, batches, train, vocab, args, packed=False):
    """Trains a fresh PyTorch model on `batches` (through a PackedSequence
    if `packed`); returns (tokens/s, last loss)."""
    torch.manual_seed(args.seed)
    model = TorchLM(cell, len(vocab), args.embedding, args.hidden, packed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = args.steps * 3 // 100
    tokens, seconds, loss = 0, 0.0, float("nan")
    for step, ids in enumerate(batches):
        seqs = [train[i] for i in ids]
        started = time.perf_counter()
        lengths = [len(s) - 1 for s in seqs]
        steps = max(lengths)
        inputs = torch.zeros(len(seqs), steps, dtype=torch.long)
        targets = torch.zeros(len(seqs), steps, dtype=torch.long)
        for b, s in enumerate(seqs):
            inputs[b, : len(s) - 1] = torch.tensor(s[:-1])
            targets[b, : len(s) - 1] = torch.tensor(s[1:])
        mask = torch.arange(steps)[None, :] < torch.tensor(lengths)[:, None]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup, 0.1)
        logits = model(inputs, lengths)
        loss = F.cross_entropy(logits[mask], targets[mask])
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        seconds += time.perf_counter() - started
        tokens += sum(lengths)
    return tokens / seconds, loss.item()


PACKABLE = ("lstm", "gru")


def describe(row):
    """One line: charlm's tokens/s, PyTorch's by each route, the ratio to its faster."""
    routes = f"padded {row['pytorch_padded'] / 1e3:6.1f}k"
    if "pytorch_packed" in row:
        routes += f", packed {row['pytorch_packed'] / 1e3:6.1f}k"
    return (f"charlm {row['charlm'] / 1e3:6.1f}k tokens/s | PyTorch {routes} tokens/s"
            f" | ratio {row['charlm'] / row['pytorch']:.2f}")


def charlm_round(cell, args, batches_file, out_dir):
    """Runs charlm; returns (tokens/s, the batches it drew)."""
    cmd = [CHARLM, "--cell", cell, "--steps", str(args.steps), "--threads", str(args.threads),
           "--hidden", str(args.hidden), "--embedding", str(args.embedding), "--lr", str(args.lr),
           "--seed", str(args.seed), "--eval-every", str(args.steps), "--samples", "0",
           "--write-batches", batches_file, "--out", out_dir]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rate = re.search(r"trained .* in [0-9.]+ s: ([0-9.]+)k tokens/s", out)
    if not rate:
        raise RuntimeError(f"no tokens/s in charlm's output:\n{out}")
    with open(batches_file) as f:
        return float(rate.group(1)) * 1e3, json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", default="lstm", choices=["lstm", "gru", "layernorm_lstm"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--embedding", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the rounds and medians here")
    args = ap.parse_args()

    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "cellc-examples", "--example", "charlm"],
                   cwd=ROOT, check=True, capture_output=True)
    torch.set_num_threads(args.threads)
    vocab, train, _ = load_corpus(DATA, 10)
    print(f"{args.cell}, H={args.hidden}, embedding {args.embedding}, {args.steps} steps of 32 verses, "
          f"{args.threads} threads, torch {torch.__version__}")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        batches_file = os.path.join(tmp, "batches.json")
        for r in range(args.rounds):
            ours, batches = charlm_round(args.cell, args, batches_file, tmp)
            padded, loss = torch_round(args.cell, batches, train, vocab, args)
            if not math.isfinite(loss):
                raise RuntimeError("PyTorch's loss is not finite")
            row = {"charlm": ours, "pytorch_padded": padded}
            if args.cell in PACKABLE:
                row["pytorch_packed"], _ = torch_round(args.cell, batches, train, vocab, args, packed=True)
            row["pytorch"] = max(row.get("pytorch_packed", 0.0), padded)
            rounds.append(row)
            print(f"round {r + 1}: " + describe(row))
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print("median:  " + describe(median))
    ours, theirs = median["charlm"], median["pytorch"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cell": args.cell, "steps": args.steps, "threads": args.threads, "torch": torch.__version__,
                       "rounds": rounds, "median": median, "ratio": ours / theirs}, f, indent=1)


if __name__ == "__main__":
    main()
