"""Per-step resets: what they cost cellc, and what PyTorch users do instead.

An LSTM over B sequences of T steps whose episodes end at random steps (on average every
`--episode` steps, as in reinforcement learning): the state restarts from h0 at each episode's
first step. Timed, forward (inference) and forward plus backward (training), float32 on the CPU:

- cellc, ``rnn(x, hx, resets=done)``: one fused call;
- cellc without resets (what the resets cost);
- PyTorch, the loop TorchRL's LSTM module runs when resets occur: ``nn.LSTM`` one step at a
  time, the state replaced by h0 where an episode starts (``torch.where``);
- PyTorch, the episodes repacked: every stretch between resets cut out, padded into a batch of
  its own and run by ``nn.LSTM`` through ``pack_padded_sequence`` (and scattered back), the
  faster of PyTorch's routes here.

Alternating rounds in one run; the fastest pass of each is kept. Prints a table and, with
``--json``, writes the figures.

    python benches/resets_speed.py [--threads 2] [--batch 16] [--steps 100] [--hidden 256] [--json F]
"""

import argparse
import json
import platform
import time

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import cellc


def episodes(batch, steps, mean, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand((steps, batch), generator=g) < 1.0 / mean


def loop(ref, x, hx, done):
    """TorchRL's fallback: one nn.LSTM call per step, the state reset where an episode starts."""
    h0, c0 = hx
    h, c = h0, c0
    outs = []
    for t in range(x.shape[0]):
        keep = ~done[t].view(1, -1, 1)
        h, c = torch.where(keep, h, h0), torch.where(keep, c, c0)
        y, (h, c) = ref(x[t : t + 1], (h, c))
        outs.append(y)
    return torch.cat(outs)


def repacked(ref, x, hx, done):
    """Every stretch between resets as a sequence of its own: cut, padded, packed, run, put back."""
    steps, batch = done.shape
    pieces, owners, spans = [], [], []
    for b in range(batch):
        cuts = [0] + [t for t in range(1, steps) if done[t, b]] + [steps]
        for first, end in zip(cuts[:-1], cuts[1:]):
            pieces.append(x[first:end, b])
            owners.append(b)
            spans.append((first, end))
    lengths = torch.tensor([e - f for f, e in spans])
    padded = nn.utils.rnn.pad_sequence(pieces)
    owners_t = torch.tensor(owners)
    h0 = tuple(h.index_select(1, owners_t) for h in hx)
    out, _ = ref(pack_padded_sequence(padded, lengths, enforce_sorted=False), h0)
    out, _ = pad_packed_sequence(out)
    rows = [out[: e - f, j] for j, (f, e) in enumerate(spans)]
    full = torch.empty(steps, batch, out.shape[-1])
    for j, (b, (f, e)) in enumerate(zip(owners, spans)):
        full[f:e, b] = rows[j]
    return full


def timed(fn, rounds):
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--episode", type=float, default=25.0, help="mean episode length, in steps")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, H = args.batch, args.steps, args.hidden
    ref = nn.LSTM(H, H)
    rnn = cellc.RNN("lstm", H, H)
    rnn.load_state_dict(ref.state_dict())
    x = torch.randn(T, B, H)
    hx = (torch.randn(1, B, H) * 0.1, torch.randn(1, B, H) * 0.1)
    done = episodes(B, T, args.episode, 1)

    # The four agree (checked once, forward).
    with torch.no_grad():
        want = loop(ref, x, hx, done)
        for name, got in [("repacked", repacked(ref, x, hx, done)), ("cellc", rnn(x, hx, resets=done)[0])]:
            err = (got - want).abs().max().item()
            assert err < 1e-4, f"{name} differs from the loop by {err}"

    def train(fn):
        def run():
            xs = x.clone().requires_grad_()
            fn(xs).sum().backward()
        return run

    def infer(fn):
        def run():
            with torch.no_grad():
                fn(x)
        return run

    routes = {
        "cellc, resets": lambda xs: rnn(xs, hx, resets=done)[0],
        "cellc, no resets": lambda xs: rnn(xs, hx)[0],
        "nn.LSTM per step (TorchRL)": lambda xs: loop(ref, xs, hx, done),
        "nn.LSTM, episodes repacked": lambda xs: repacked(ref, xs, hx, done),
    }
    results = {}
    for mode, wrap in (("infer", infer), ("train", train)):
        fns = {name: wrap(fn) for name, fn in routes.items()}
        for fn in fns.values():
            fn()  # warm up
        best = {name: float("inf") for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                best[name] = min(best[name], timed(fn, 1))
        results[mode] = {name: t * 1e3 for name, t in best.items()}

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    print(f"LSTM B={B} T={T} H={H}, episodes of {args.episode:g} steps on average "
          f"({int(done[1:].sum())} resets), {args.threads} threads, {cpu}")
    print("| route | infer ms | train ms |")
    print("|---|---|---|")
    for name in routes:
        print(f"| {name} | {results['infer'][name]:.2f} | {results['train'][name]:.2f} |")
    for mode in ("infer", "train"):
        r = results[mode]
        faster = min(r["nn.LSTM per step (TorchRL)"], r["nn.LSTM, episodes repacked"])
        print(f"{mode}: cellc with resets {faster / r['cellc, resets']:.2f}x PyTorch's faster route; "
              f"resets cost cellc {r['cellc, resets'] / r['cellc, no resets']:.2f}x")
    if args.json:
        meta = dict(vars(args), cpu=cpu, resets=int(done[1:].sum()), date=time.strftime("%Y-%m-%d"),
                    torch=torch.__version__)
        with open(args.json, "w") as f:
            json.dump({"config": meta, "ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
