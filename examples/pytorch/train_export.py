"""Trains a character-level LSTM language model in PyTorch and exports it for cellc.

    python examples/pytorch/train_export.py [--steps 1500] [--out examples/pytorch/charlm_lstm.safetensors]

The model is nn.Embedding(V, 64) -> nn.LSTM(64, 128) -> nn.Linear(128, V), trained on the
same text, split and sequences as `examples/charlm.rs` (one verse per line, every tenth
verse held out for validation, each verse read as "\\n" + verse and predicting verse + "\\n"),
with Adam, global-norm gradient clipping and a warm-up + cosine learning-rate schedule,
batched as padded variable-length sequences packed with pack_padded_sequence.

Its state_dict is saved with safetensors.torch.save_file under the names cellc's
`charlm` checkpoints use (embedding.weight, rnn.weight_ih_l0, rnn.weight_hh_l0,
rnn.bias_ih_l0, rnn.bias_hh_l0, head.weight, head.bias): the nn.LSTM weights load
unchanged into cells/lstm.cell. The metadata holds the vocabulary (`vocab`, the
characters in id order) and the validation loss of the exported weights (`valid_loss`,
nats per character, evaluated in float64), which
`cargo run --release -p cellc-examples --example charlm_pytorch` and the test
`charlm` compare with what cellc computes from the same file.

Needs torch and safetensors; CI does not: the exported file is committed.
"""

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "genesis_exodus_kjv.txt")


class CharLM(nn.Module):
    def __init__(self, vocab, embedding, hidden):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding)
        self.rnn = nn.LSTM(embedding, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, inputs, lengths):
        """Logits [B, T, V] of padded batch-first inputs with real lengths."""
        x = self.embedding(inputs)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=inputs.shape[1])
        return self.head(out)


def load_corpus(path, valid_every):
    """Vocabulary and (train, valid) lists of token lists, exactly as charlm's text.rs."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text) | {"\n"})
    ids = {c: i for i, c in enumerate(vocab)}
    lines = [l.rstrip("\r") for l in text.split("\n")]
    lines = [l for l in lines if l.strip()]
    train, valid = [], []
    for i, line in enumerate(lines):
        tokens = [ids["\n"]] + [ids[c] for c in line] + [ids["\n"]]
        (valid if (i + 1) % valid_every == 0 else train).append(tokens)
    return vocab, train, valid


def make_batch(seqs):
    """Padded inputs, targets, mask and lengths of token lists."""
    lengths = torch.tensor([len(s) - 1 for s in seqs])
    steps = int(lengths.max())
    inputs = torch.zeros(len(seqs), steps, dtype=torch.long)
    targets = torch.zeros(len(seqs), steps, dtype=torch.long)
    for b, s in enumerate(seqs):
        inputs[b, : len(s) - 1] = torch.tensor(s[:-1])
        targets[b, : len(s) - 1] = torch.tensor(s[1:])
    mask = torch.arange(steps)[None, :] < lengths[:, None]
    return inputs, targets, mask, lengths


def masked_nll(model, batch):
    """Summed cross-entropy over the real positions, and their count."""
    inputs, targets, mask, lengths = batch
    logits = model(inputs, lengths)
    nll = F.cross_entropy(logits[mask], targets[mask], reduction="sum")
    return nll, int(mask.sum())


def epochs(train, batch_size, generator, bucket=16):
    """Bucketed batches forever: shuffle, sort windows of `bucket` batches by length, cut, shuffle."""
    while True:
        order = torch.randperm(len(train), generator=generator).tolist()
        batches = []
        window = batch_size * bucket
        for w in range(0, len(order), window):
            chunk = sorted(order[w : w + window], key=lambda i: len(train[i]))
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        for j in torch.randperm(len(batches), generator=generator).tolist():
            yield [train[i] for i in batches[j]]


def lr_at(step, steps, lr, warmup, final_fraction):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
    return lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_step(model, opt, seqs, lr, clip):
    """One Adam step at `lr` on a batch of token lists, gradients clipped to norm `clip`:
    the batch's mean loss per character, and how many characters it had."""
    for group in opt.param_groups:
        group["lr"] = lr
    nll, n = masked_nll(model, make_batch(seqs))
    loss = nll / n
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss, n


@torch.no_grad()
def evaluate(model, valid, batch_size=64):
    model.eval()
    total, count = 0.0, 0
    ordered = sorted(valid, key=len, reverse=True)
    for i in range(0, len(ordered), batch_size):
        nll, n = masked_nll(model, make_batch(ordered[i : i + batch_size]))
        total += float(nll)
        count += n
    model.train()
    return total / count


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--embedding", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--valid-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "charlm_lstm.safetensors"))
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    vocab, train, valid = load_corpus(DATA, args.valid_every)
    model = CharLM(len(vocab), args.embedding, args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    warmup = args.steps * 3 // 100
    batches = epochs(train, args.batch, torch.Generator().manual_seed(args.seed))
    print(f"{len(train)} training verses, {len(valid)} validation, {len(vocab)} symbols; "
          f"{sum(p.numel() for p in model.parameters())} parameters")
    started, tokens = time.time(), 0
    for step in range(args.steps):
        loss, n = train_step(model, opt, next(batches), lr_at(step, args.steps, args.lr, warmup, 0.1), args.clip)
        tokens += n
        if (step + 1) % (args.steps // 10) == 0 or step == 0:
            print(f"step {step + 1}/{args.steps}: batch loss {loss.item():.3f}, "
                  f"validation {evaluate(model, valid):.3f}, {tokens / (time.time() - started):.0f} chars/s")

    # The exported weights' validation loss, in float64 so that it is the
    # float32 weights' own value, not one more float32 rounding.
    valid_loss = evaluate(model.double(), valid)
    model.float()
    print(f"validation loss of the exported weights: {valid_loss:.6f} nats/char "
          f"(perplexity {math.exp(valid_loss):.3f})")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    metadata = {
        "vocab": "".join(vocab),
        "valid_loss": repr(valid_loss),
        "valid_every": str(args.valid_every),
        "trained_on": "examples/data/genesis_exodus_kjv.txt",
        "trainer": f"examples/pytorch/train_export.py, torch {torch.__version__}",
        "steps": str(args.steps),
        "batch": str(args.batch),
        "lr": str(args.lr),
        "seed": str(args.seed),
    }
    save_file(state, args.out, metadata=metadata)
    print(f"wrote {os.path.relpath(args.out)} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
