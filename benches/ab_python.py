"""A/B of two cellc Python packages on the CPU: the same cellc.RNN calls, run alternately in one run.

    python benches/ab_python.py OLD_SITE NEW_SITE [--rounds 3] [--quick] [--json out.json]

OLD_SITE and NEW_SITE are folders holding an installed `cellc` package each (`pip install
--no-deps --target DIR cellc-*.whl`); torch comes from the Python that runs this script. Each
round runs one subprocess per package, old then new, with its folder first on `sys.path`; a
subprocess times every shape once (the median of its repetitions) and the script keeps each
package's fastest median over the rounds. Shapes, as `benches/python_vs_nn.py` calls them:
LSTM and GRU, T=100, lengths uniform in [T/2, T] (unsorted, padded batch-first), B in {1, 16,
64}, H=256, inference (no_grad) and training (forward and backward of out.sum()); bf16
autocast (LSTM, B=16); the generation step (B=1, T=1, H=256, the state carried); 2 threads.
The ratio is old / new: above 1, the new package is faster. Only the ratios of one run are
comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One subprocess: times every shape of argv[1] (JSON) with the cellc found first on sys.path.
WORKER = r"""
import json, statistics, sys, time
import torch
import cellc
sys.path.insert(0, sys.argv[2])
from compare_pytorch import lengths_uniform
torch.set_num_threads(int(sys.argv[3]))
min_time = float(sys.argv[4])

def median_time(fn):
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < 2000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

out = {}
for key in json.loads(sys.argv[1]):
    cell, b, t, h, mode = key.split(",")
    b, t, h = int(b), int(t), int(h)
    torch.manual_seed(0)
    rnn = cellc.RNN(cell, h, h, batch_first=True)
    x = torch.randn(b, t, h)
    if mode == "generate":
        state = None
        def step():
            global state
            with torch.no_grad():
                _, state = rnn(x, state)
        out[key] = median_time(step)
        continue
    lengths = torch.tensor(lengths_uniform(b, t))
    autocast = mode.endswith("-bf16")
    train = mode.startswith("train")
    xs = x.requires_grad_() if train else x
    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if train:
                y, _ = rnn(xs, lengths=lengths)
                y.float().sum().backward()
            else:
                with torch.no_grad():
                    rnn(xs, lengths=lengths)
    out[key] = median_time(call)
print(json.dumps(out))
"""


def shapes(quick: bool) -> list[str]:
    batches = [16] if quick else [1, 16, 64]
    keys = [f"{cell},{b},100,256,{mode}" for cell in ["lstm", "gru"] for b in batches for mode in ["infer", "train"]]
    keys += ["lstm,16,100,256,infer-bf16", "lstm,16,100,256,train-bf16", "lstm,1,1,256,generate"]
    return keys


def run(site: str, keys: list[str], threads: int, min_time: float) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=site)
    cmd = [sys.executable, "-c", WORKER, json.dumps(keys), os.path.join(ROOT, "benches"), str(threads),
           str(min_time)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="B=16 only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--json")
    args = parser.parse_args()
    keys = shapes(args.quick)
    best: dict[str, dict[str, float]] = {"old": {}, "new": {}}
    for _ in range(args.rounds):
        for name, site in [("old", args.old), ("new", args.new)]:
            for key, s in run(site, keys, args.threads, args.min_time).items():
                best[name][key] = min(best[name].get(key, s), s)
    rows = []
    print("| cell | B | T | H | mode | old (ms) | new (ms) | old / new |")
    print("|---|---|---|---|---|---|---|---|")
    for key in keys:
        cell, b, t, h, mode = key.split(",")
        old, new = best["old"][key], best["new"][key]
        rows.append({"cell": cell, "batch": int(b), "steps": int(t), "hidden": int(h), "mode": mode,
                     "old_s": old, "new_s": new, "ratio": old / new})
        print(f"| {cell} | {b} | {t} | {h} | {mode} | {old * 1e3:.3f} | {new * 1e3:.3f} | {old / new:.3f} |")
    ratios = [r["ratio"] for r in rows]
    geo = statistics.geometric_mean(ratios)
    print(f"geometric mean {geo:.3f}; lowest {min(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "geometric_mean": geo}, f, indent=1)


if __name__ == "__main__":
    main()
