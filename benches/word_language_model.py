#!/usr/bin/env python3
"""PyTorch's `word_language_model` example with `nn.LSTM` swapped for `cellc.RNN`, side by side.

    python benches/word_language_model.py [--steps 60] [--threads 2] [--json out.json]

The example's model and training loop (pytorch/examples, word_language_model: main.py,
model.py, generate.py) as they are, on this repository's corpus (Genesis and Exodus, word
level, as the example's data.py tokenises: words split on spaces, `<eos>` at each line's end):
an embedding of 200, a 2-layer LSTM of 200 (`nn.LSTM(ninp, nhid, nlayers, dropout=...)`),
dropout 0.2 around it (between the layers too: cellc.RNN has no dropout argument yet, so its
model runs one module per layer with `nn.Dropout` between them, as a user must today; the two
then draw their masks in another order, so their losses agree only with `--dropout 0`), a
linear decoder, bptt 35, batch 20, every sequence at full length, stateful batches (the hidden
state carried and detached), plain SGD at lr 20 with gradient clipping at 0.25.

Both models start from the same weights (cellc's module loads nn.LSTM's state dict) and the
same seed, and run alternately in one process, chunk by chunk, so the machine's state is the
same for both. Reports tokens/s of training and evaluation, the RNN's own time per step
(forward, backward), the losses of both (the same trajectory within float noise), and
word-by-word generation (generate.py's loop: one word per call, B=1, T=1).
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn

import cellc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "examples", "data", "genesis_exodus_kjv.txt")


def tokenize(path):
    """data.py's Corpus: every word of every line, then `<eos>`."""
    words, ids = {}, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            for w in line.split() + ["<eos>"]:
                ids.append(words.setdefault(w, len(words)))
    return torch.tensor(ids, dtype=torch.int64), len(words)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


class CellcLSTM(nn.Module):
    """`nn.LSTM(ninp, nhid, nlayers, dropout=p)` as cellc modules: one per layer with dropout
    between them (what a user writes while cellc.RNN has no `dropout`)."""

    def __init__(self, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.layers = nn.ModuleList(cellc.RNN("lstm", ninp if k == 0 else nhid, nhid) for k in range(nlayers))
        self.drop = nn.Dropout(dropout)

    def load_lstm(self, lstm):
        for k, layer in enumerate(self.layers):
            layer.load_state_dict({n.replace(f"_l{k}", "_l0"): p for n, p in lstm.state_dict().items()
                                   if n.endswith(f"_l{k}")})

    def forward(self, x, hidden):
        h, c = hidden
        finals_h, finals_c = [], []
        for k, layer in enumerate(self.layers):
            if k > 0:
                x = self.drop(x)
            x, (hk, ck) = layer(x, (h[k : k + 1], c[k : k + 1]))
            finals_h.append(hk)
            finals_c.append(ck)
        return x, (torch.cat(finals_h), torch.cat(finals_c))


class RNNModel(nn.Module):
    """model.py's RNNModel (LSTM, untied)."""

    def __init__(self, rnn, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = rnn
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.decoder.out_features)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    return tuple(v.detach() for v in h)


class Timed(nn.Module):
    """Times the wrapped RNN's forward, and its backward through a hook on its output."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn
        self.forward_s = self.backward_s = 0.0
        self._backward_start = None

    def forward(self, x, hidden):
        if x.requires_grad:
            x.register_hook(self._backward_done)
        start = time.perf_counter()
        out, hidden = self.rnn(x, hidden)
        self.forward_s += time.perf_counter() - start
        if out.requires_grad:
            out.register_hook(self._backward_begins)
        return out, hidden

    def _backward_begins(self, g):
        self._backward_start = time.perf_counter()

    def _backward_done(self, g):
        if self._backward_start is not None:
            self.backward_s += time.perf_counter() - self._backward_start
            self._backward_start = None


class Run:
    """One model's training state, advanced a chunk of steps at a time."""

    def __init__(self, name, model, train_data, args):
        self.name, self.model, self.data, self.args = name, model, train_data, args
        self.hidden = model.init_hidden(args.batch_size)
        self.i = 0
        self.losses, self.train_s, self.tokens = [], 0.0, 0
        self.criterion = nn.NLLLoss()

    def train(self, steps, seed):
        args, model = self.args, self.model
        torch.manual_seed(seed)
        model.train()
        start = time.perf_counter()
        for _ in range(steps):
            if self.i >= self.data.size(0) - 1:
                self.i, self.hidden = 0, model.init_hidden(args.batch_size)
            data, targets = get_batch(self.data, self.i, args.bptt)
            model.zero_grad()
            self.hidden = repackage_hidden(self.hidden)
            output, self.hidden = model(data, self.hidden)
            loss = self.criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-args.lr)
            self.losses.append(loss.item())
            self.tokens += data.numel()
            self.i += args.bptt
        self.train_s += time.perf_counter() - start

    def evaluate(self, data_source):
        model = self.model
        model.eval()
        total, hidden = 0.0, model.init_hidden(10)
        start = time.perf_counter()
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, self.args.bptt):
                data, targets = get_batch(data_source, i, self.args.bptt)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total += len(data) * nn.functional.nll_loss(output, targets).item()
        return total / (len(data_source) - 1), time.perf_counter() - start, data_source.numel()

    def generate(self, words, ntokens):
        """generate.py's loop: one word per call."""
        model = self.model
        model.eval()
        torch.manual_seed(1)
        hidden = model.init_hidden(1)
        input = torch.randint(ntokens, (1, 1), dtype=torch.long)
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(words):
                output, hidden = model(input, hidden)
                word_weights = output.squeeze().div(1.0).exp()
                input.fill_(torch.multinomial(word_weights, 1)[0])
        return (time.perf_counter() - start) / words


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="training steps per model")
    ap.add_argument("--chunk", type=int, default=10, help="steps per turn (the models alternate)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--words", type=int, default=200, help="words generated per model")
    ap.add_argument("--dropout", type=float, default=0.2,
                    help="the example's 0.2; at 0 both models draw no masks and their losses must agree")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.emsize = args.nhid = 200
    args.nlayers, args.lr, args.clip, args.bptt, args.batch_size = 2, 20.0, 0.25, 35, 20
    torch.set_num_threads(args.threads)
    ids, ntokens = tokenize(CORPUS)
    split = int(len(ids) * 0.9)
    train_data, val_data = batchify(ids[:split], args.batch_size), batchify(ids[split:], 10)

    torch.manual_seed(1111)
    lstm = nn.LSTM(args.emsize, args.nhid, args.nlayers, dropout=args.dropout)
    torch_model = RNNModel(Timed(lstm), ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
    cellc_rnn = CellcLSTM(args.emsize, args.nhid, args.nlayers, args.dropout)
    cellc_rnn.load_lstm(lstm)
    cellc_model = RNNModel(Timed(cellc_rnn), ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
    cellc_model.encoder.load_state_dict(torch_model.encoder.state_dict())
    cellc_model.decoder.load_state_dict(torch_model.decoder.state_dict())
    runs = [Run("nn.LSTM", torch_model, train_data, args), Run("cellc.RNN", cellc_model, train_data, args)]

    # Warm-up (compilation, first allocations), not counted; then alternate.
    for r in runs:
        r.train(2, seed=0)
        r.losses, r.train_s, r.tokens = [], 0.0, 0
        r.model.rnn.forward_s = r.model.rnn.backward_s = 0.0
        r.i, r.hidden = 0, r.model.init_hidden(args.batch_size)
    done = 0
    while done < args.steps:
        n = min(args.chunk, args.steps - done)
        for r in runs:
            r.train(n, seed=done)
        done += n
    rows = []
    for r in runs:
        steps = len(r.losses)
        rnn = r.model.rnn
        fwd, bwd = rnn.forward_s / steps * 1e3, rnn.backward_s / steps * 1e3
        rnn.forward_s = 0.0
        val_loss, eval_s, eval_tokens = r.evaluate(val_data)
        eval_rnn = rnn.forward_s / math.ceil((val_data.size(0) - 1) / args.bptt) * 1e3
        per_word = r.generate(args.words, ntokens)
        rows.append({
            "model": r.name, "train_tokens_per_s": r.tokens / r.train_s, "train_step_ms": r.train_s / steps * 1e3,
            "rnn_forward_ms": fwd, "rnn_backward_ms": bwd, "eval_tokens_per_s": eval_tokens / eval_s,
            "eval_rnn_ms_per_batch": eval_rnn, "generate_us_per_word": per_word * 1e6,
            "first_losses": [round(x, 4) for x in r.losses[:5]], "last_loss": r.losses[-1], "val_loss": val_loss,
            "losses": [round(x, 5) for x in r.losses],
        })
    t, c = rows
    print(f"torch {torch.__version__}, {args.threads} thread(s), cellc threading {cellc.threading()}, "
          f"{args.steps} steps of {args.bptt}x{args.batch_size} tokens, dropout {args.dropout}")
    drift = max(abs(a - b) for a, b in zip(t["first_losses"] + [t["last_loss"]], c["first_losses"] + [c["last_loss"]]))
    for r in rows:
        print(f"{r['model']:>10}: train {r['train_tokens_per_s']:8.0f} tok/s ({r['train_step_ms']:.1f} ms/step; RNN "
              f"fwd {r['rnn_forward_ms']:.2f} + bwd {r['rnn_backward_ms']:.2f} ms) | eval "
              f"{r['eval_tokens_per_s']:8.0f} tok/s (RNN {r['eval_rnn_ms_per_batch']:.2f} ms/batch) | generate "
              f"{r['generate_us_per_word']:.0f} us/word | loss {r['first_losses'][0]:.3f} -> {r['last_loss']:.3f}, "
              f"val {r['val_loss']:.3f}")
    print(f"cellc / torch: train {c['train_tokens_per_s'] / t['train_tokens_per_s']:.2f}x, eval "
          f"{c['eval_tokens_per_s'] / t['eval_tokens_per_s']:.2f}x, generate "
          f"{t['generate_us_per_word'] / c['generate_us_per_word']:.2f}x; largest loss difference {drift:.4f}"
          + (" (dropout: the two draw their masks in another order)" if args.dropout else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "dropout": args.dropout, "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
