"""The character-level language model of train_export.py with nn.LSTM swapped for a custom cell.

    pip install ./runtime/python          # the cellc package (needs torch)
    python examples/pytorch/train_cellc.py [--cell layernorm_lstm] [--steps 600]

Same data, batches, optimiser, clipping and schedule as train_export.py; the RNN is
`cellc.RNN(<cell>)`, fed the padded batch with its lengths: no pack_padded_sequence, no
sorting. `--cell` is a shipped cell's name (`lstm`, `gru`, `layernorm_lstm`, `mi_lstm`, ...),
a `.cell` file, or `inline` for the cell written below in this file. `--torch` trains the
original nn.LSTM model instead, for comparison. Prints the validation loss and characters/s.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_export import DATA, CharLM, epochs, evaluate, load_corpus, lr_at, train_step  # noqa: E402

import cellc  # noqa: E402

# A cell of our own: an LSTM whose candidate mixes input and state by multiplicative
# integration (Wu et al. 2016), with a learned per-unit forget bias.
INLINE_CELL = """
cell mi_candidate_lstm {
    input  x[I]
    state  h[H], c[H]
    param  weight_ih[4*H, I], weight_hh[4*H, H], bias[4*H] = zeros
    param  forget_bias[H] = ones
    let wx = weight_ih @ x
    let uh = weight_hh @ h
    let i, f, g, o = chunk(wx + uh + bias, 4)
    let xi, xf, xg, xo = chunk(wx, 4)
    let hi, hf, hg, ho = chunk(uh, 4)
    c' = sigmoid(f + forget_bias) * c + sigmoid(i) * tanh(g + xg * hg)
    h' = sigmoid(o) * tanh(c')
    output h'
}
"""


class CellcCharLM(nn.Module):
    """Embedding -> cellc.RNN(cell) -> Linear, on padded batches with lengths."""

    def __init__(self, vocab, embedding, hidden, cell):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding)
        self.rnn = cellc.RNN(cell, embedding, {"H": hidden}, batch_first=True)
        self.head = nn.Linear(self.rnn.output_size, vocab)

    def forward(self, inputs, lengths):
        out, _ = self.rnn(self.embedding(inputs), lengths=lengths)
        return self.head(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cell", default="layernorm_lstm")
    parser.add_argument("--torch", action="store_true", help="train train_export.py's nn.LSTM model instead")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--embedding", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    vocab, train, valid = load_corpus(DATA, 10)
    if args.torch:
        model, name = CharLM(len(vocab), args.embedding, args.hidden), "nn.LSTM"
    else:
        cell = INLINE_CELL if args.cell == "inline" else args.cell
        model = CellcCharLM(len(vocab), args.embedding, args.hidden, cell)
        name = f"cellc.RNN({model.rnn.cell!r})"
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    batches = epochs(train, args.batch, torch.Generator().manual_seed(args.seed))
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, {len(train)} training verses")
    started, tokens, first = time.time(), 0, None
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.steps * 3 // 100, 0.1)
        loss, n = train_step(model, opt, next(batches), lr, args.clip)
        tokens += n
        first = loss.item() if first is None else first
        if (step + 1) % max(args.steps // 6, 1) == 0:
            print(f"step {step + 1}/{args.steps}: batch loss {loss.item():.3f}, {tokens / (time.time() - started):.0f} chars/s")
    print(f"validation loss {evaluate(model, valid):.3f} nats/char (first batch {first:.3f}); "
          f"{tokens / (time.time() - started):.0f} chars/s on {args.threads} threads")


if __name__ == "__main__":
    main()
