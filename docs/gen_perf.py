#!/usr/bin/env python3
"""Write the book's performance tables from the benchmarks' results.

    python3 docs/gen_perf.py          # (re)write docs/src/performance/tables/*.md
    python3 docs/gen_perf.py --check  # exit 1, naming them, if the committed tables are stale

Reads `benches/results/*.json` (written by the scripts in `benches/`) and writes one Markdown
file per table under `docs/src/performance/tables/`; the pages of `docs/src/performance/`
include them with `{{#include tables/NAME.md}}`. Every file opens with the machine and the date
of its measurement. Both are taken from the JSON where the script recorded them; where it did
not, from `PROVENANCE` below, written from the README of the commit that added the file and
that commit's date (`git log --format=%ad --date=short -- benches/results/FILE`), and marked as
such in the table. Standard library only, and the output depends on nothing but the JSON: the
same results always give the same bytes.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))
import report  # noqa: E402 (the GPU check's tables: tests/gpu/report.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benches", "results")
TABLES = os.path.join(ROOT, "docs", "src", "performance", "tables")

# What a results file does not record about itself: (machine, date, PyTorch), from the README
# of the commit that added it and that commit's date. None: the file records it.
PROVENANCE = {
    "full_comparison.json": ("Intel Xeon, 2 cores, AVX-512, 2 MiB L2 per core", "2026-11-24", "2.15 (CPU)"),
    "module_comparison.json": ("Intel Xeon, 2 cores, AVX-512", "2026-11-25", "2.15 (CPU)"),
    "charlm_side_by_side.json": (None, "2026-11-25", None),
    "charlm_side_by_side_zen5.json": (None, "2026-11-25", None),
    "word_language_model.json": ("Intel Xeon, 2 cores, AVX-512", None, None),
    "masks_speed_zen3.json": (None, "2026-11-27", "not used"),
    "export_speed_xeon_amx.json": (None, "2026-12-02", None),
}

# What the README says of a processor that a file names only by its brand string.
MACHINE_NOTES = {
    "python_vs_nn.json": "2 cores, AVX-512, a shared virtual machine",
    "python_vs_nn_zen3.json": "Zen 3, 2 cores, AVX2 + FMA, no AVX-512, a shared virtual machine",
    "python_vs_nn_dropout_zen3.json": "Zen 3, 2 cores, AVX2 + FMA, no AVX-512",
    "resets_speed_zen3.json": "Zen 3, 2 cores, AVX2 + FMA, no AVX-512",
    "masks_speed_zen3.json": "Zen 3, 2 cores, AVX2 + FMA, no AVX-512",
    "bf16_speed_zen3.json": "Zen 3, 2 cores, AVX2 + FMA: no bf16 instructions",
    "bf16_speed_xeon.json": "2 cores, AVX-512 with AVX512-BF16, no AMX",
    "bf16_speed_xeon_amx.json": "2 cores, AVX-512 with AVX512-BF16 and AMX",
    "peak_xeon_amx.json": "2 cores, AVX-512 with AVX512-BF16 and AMX",
    "slstm_speed_xeon.json": "2 cores, AVX-512 with AVX512-BF16, no AMX",
    "python_vs_nn_zen4_2026-12-01.json": "Zen 4, 2 cores, AVX-512 with AVX512-BF16, a shared virtual machine",
    "export_speed_xeon_amx.json": "2 cores, AVX-512 with AVX512-BF16 and AMX",
    "export_speed_zen5.json": "Zen 5, 2 cores, AVX-512 with AVX512-BF16",
}

# Shown in the list of sources, but not as tables of their own.
NOT_SHOWN = {
    "ab_issue30_zen3.json": "A/B of two cellc builds (issue 30), old / new; internal",
    "ab_issue30_plan_zen3.json": "A/B of two cellc builds (issue 30's pass plan), old / new; internal",
    "ab_issue50_cli_zen5.json": "A/B of two cellc builds (issue 50's device trait), `cellc bench`, old / new; internal",
    "ab_issue50_python_zen5.json": "A/B of two cellc packages (issue 50's device trait), cellc.RNN, old / new; internal",
    "python_vs_nn_zen3_issue30_quick.json": "`--quick` run (B=16, H=256) after issue 30; superseded by the full grid",
    "python_vs_nn_zen3_issue30_plan_quick.json": "`--quick` run (B=16, H=256) after issue 30's pass plan; superseded",
}


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def provenance(name, data):
    """(machine, date, torch) of a results file: recorded, else PROVENANCE's (marked)."""
    meta = data.get("meta", data.get("config", data)) if isinstance(data, dict) else {}
    machine = meta.get("cpu") or meta.get("machine")
    date = meta.get("date")
    torch = meta.get("torch")
    if isinstance(data, dict) and "device" in data:  # the GPU checks: every run's day
        dev = data["device"]
        machine = f"{dev.get('name', 'no GPU (the emulated device)')}, driver {dev.get('driver', '-')}"
        torch = dev["python_torch_cuda"].split()[1]
        days = sorted({run["device"]["date"][:10] for run in gpu_runs(data)})
        date = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    if isinstance(data, dict) and "cells" in data:  # charlm side by side: per cell
        torch = next(iter(data["cells"].values())).get("torch")
    known = PROVENANCE.get(name, (None, None, None))
    if machine is None and known[0]:
        machine = known[0] + " (not in the JSON: from the notes of the commit that added it)"
    if date is None and known[1]:
        date = known[1] + " (not in the JSON: the date it was committed)"
    if torch is None and known[2]:
        torch = known[2]
    if name in MACHINE_NOTES:
        machine = f"{machine} ({MACHINE_NOTES[name]})"
    return machine or "not recorded", date or "not recorded", torch


def header(sources, extra="", data=None):
    """The provenance line that opens every table file; `data`: the sources' JSON by name, where
    they are not (all) files of benches/results."""
    lines = [f"<!-- Written by docs/gen_perf.py from {', '.join('benches/results/' + s for s in sources)}: "
             "do not edit; run python3 docs/gen_perf.py. -->", ""]
    for s in sources:
        machine, date, torch = provenance(s, (data or {}).get(s) or load(s))
        torch_text = f"; PyTorch {torch}" if torch and torch != "not used" else ""
        lines.append(f"*Machine: {machine}; date: {date}{torch_text}; results: `benches/results/{s}`.{extra}*")
        lines.append("")
    return lines


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    out.append("")
    return out


def pick(rows, **key):
    """The one row whose fields equal `key`'s."""
    return next(r for r in rows if all(r[k] == v for k, v in key.items()))


def r2(x):
    return f"{x:.2f}"


def shapes(rows):
    return list(dict.fromkeys((r["batch"], r["hidden"]) for r in rows))


# ---- CPU against PyTorch: benches/compare_pytorch.py -------------------------------------------

COLS = [("infer", 1), ("infer", 2), ("train", 1), ("train", 2)]


def col_name(mode, threads):
    return f"{mode} {threads}t"


def cpu_nn(rows, cell, variant):
    """One line per shape: the ratio to PyTorch's faster route, then to each route."""
    mine = [r for r in rows if r["cell"] == cell and r["variant"] == variant]
    body = []
    for b, h in shapes(mine):
        line = [b, h]
        for mode, threads in COLS:
            r = pick(mine, batch=b, hidden=h, mode=mode, threads=threads)
            each = " / ".join(r2(v["ratio"]) for v in r["routes"].values())
            line.append(f"**{r2(r['ratio'])}** ({each})")
        body.append(line)
    routes = " / ".join(next(iter(mine))["routes"])
    return table(["B", "H"] + [col_name(*c) for c in COLS], body), routes


def cpu_custom(rows, cell):
    """One line per shape: the ratio to the TorchScript cell / to the eager Python loop."""
    mine = [r for r in rows if r["cell"] == cell]
    body = []
    for b, h in shapes(mine):
        line = [b, h]
        for mode, threads in COLS:
            pick = {r["variant"]: r for r in mine
                    if (r["batch"], r["hidden"], r["mode"], r["threads"]) == (b, h, mode, threads)}
            line.append(f"{r2(pick['torchscript']['ratio'])} / {r2(pick['loop']['ratio'])}")
        body.append(line)
    return table(["B", "H"] + [col_name(*c) for c in COLS], body)


def gen_cpu():
    src = "full_comparison.json"
    rows = load(src)
    files = {}
    lead = ("T=100, I=H, lengths uniform in [T/2, T]; PyTorch time / cellc time (above 1: cellc is "
            "faster).")
    for cell in ("lstm", "gru"):
        t, routes = cpu_nn(rows, cell, "nn")
        files[f"cpu_{cell}.md"] = header([src]) + [
            f"**{cell}** against `nn.{cell.upper()}`. {lead} In bold, the ratio to PyTorch's faster "
            f"route; in brackets, to each route ({routes}).", ""] + t
    t, routes = cpu_nn(rows, "layernorm_lstm", "nn.LSTM")
    files["cpu_layernorm_lstm.md"] = header([src]) + [
        f"**layernorm_lstm** against `nn.LSTM` at the same shape. {lead} In bold, the ratio to "
        f"`nn.LSTM`'s faster route; in brackets, to each route ({routes}).", ""] + t + [
        "**layernorm_lstm** against the same cell as a TorchScript cell / as an eager Python loop "
        "over time.", ""] + cpu_custom(rows, "layernorm_lstm")
    for cell in ("sru", "mingru"):
        files[f"cpu_{cell}.md"] = header([src]) + [
            f"**{cell}** against the same cell as a TorchScript cell / as an eager Python loop over "
            f"time. {lead}", ""] + cpu_custom(rows, cell)
    # The GEMM fraction: the model's product rate over the same products timed alone (inference).
    body = []
    nn_rows = [r for r in rows if r["variant"] == "nn" and r["mode"] == "infer"]
    for b, h in shapes(nn_rows):
        line = [b, h]
        for cell in ("lstm", "gru"):
            for threads in (1, 2):
                r = pick(nn_rows, cell=cell, batch=b, hidden=h, threads=threads)
                line.append(f"{r['gemm_fraction']:.2f} ({r['cellc_gflops']:.0f} / {r['gemm_only_gflops']:.0f})")
        body.append(line)
    files["cpu_gemm_fraction.md"] = header([src]) + [
        "GEMM fraction of `cellc bench`, inference: the model's matrix-product rate over the rate "
        "of the same products timed alone; in brackets, the two rates in GFLOP/s.", ""] + table(
        ["B", "H", "lstm 1t", "lstm 2t", "gru 1t", "gru 2t"], body)
    return files


def gen_masks():
    src = "masks_speed_zen3.json"
    d = load(src)
    s = d["shape"]
    body = []
    for mode in ("train", "infer"):
        r = d["results"][mode]
        ratios = r["round_ratios"]
        body.append([mode, f"{r['lstm_min_s'] * 1e3:.1f}", f"{r['masked_min_s'] * 1e3:.1f}",
                     f"{100 * r['overhead']:+.1f}%", f"{min(ratios):.2f}-{max(ratios):.2f}"])
    return {"masks.md": header([src]) + [
        f"`benches/masks_speed.py`: an LSTM with zoneout on h and c and variational dropout on its "
        f"input against `cells/lstm.cell`, B={s['batch']}, H=I={s['hidden']}, T={s['steps']}, every "
        f"sequence full length, {s['threads']} threads, {s['rounds']} alternating rounds, each run's "
        "fastest pass kept.", ""] + table(
        ["mode", "lstm (ms)", "with masks (ms)", "cost of the masks", "each round's ratio"], body)}


# ---- From Python: benches/python_vs_nn.py and the others run from Python ----------------------

def python_tables(src):
    d = load(src)
    rows = d["rows"]
    out = header([src], f" cellc threading: {d['meta']['threading'][0]}.") + [
        "PyTorch time / `cellc.RNN` time (above 1: cellc is faster), against the faster of `nn`'s "
        "padded and packed routes.", ""]
    for cell in dict.fromkeys(r["cell"] for r in rows if r["kind"] in ("varlen", "full")):
        for kind, steps in (("varlen", 100), ("full", 35), ("full", 100)):
            mine = [r for r in rows if r["cell"] == cell and r["kind"] == kind and r["steps"] == steps]
            if not mine:
                continue
            cols = list(dict.fromkeys((r["mode"], r["threads"]) for r in mine))
            what = "lengths uniform in [T/2, T]" if kind == "varlen" else "every sequence full length"
            out += [f"**{cell}**, T={steps}, {what}", ""]
            body = []
            for b, h in shapes(mine):
                line = [b, h]
                for m, t in cols:
                    r = next((r for r in mine if (r["batch"], r["hidden"], r["mode"], r["threads"]) == (b, h, m, t)),
                             None)
                    line.append(r2(r["ratio"]) if r else "")
                body.append(line)
            out += table(["B", "H"] + [col_name(m, t) for m, t in cols], body)
    body = []
    for r in rows:
        if r["kind"] == "generate":
            body.append([f"one step per call, {r['cell']}, B=1, T=1, H={r['hidden']}", r["threads"],
                         f"{r['cellc_s'] * 1e6:.1f}", f"`nn` {r['nn_s'] * 1e6:.1f}", f"**{r2(r['ratio'])}**"])
            if "frozen_s" in r:  # measured since RNN.frozen() (2026-11-30)
                body.append([f"the same inside `RNN.frozen()`", r["threads"], f"{r['frozen_s'] * 1e6:.1f}",
                             f"`nn` {r['nn_s'] * 1e6:.1f}", f"**{r2(r['frozen_ratio'])}**"])
    for r in rows:
        if r["kind"] == "fixed":
            body.append([f"fixed cost, {r['cell']}, B=1, T={r['steps']}, H={r['hidden']}, inference", r["threads"],
                         f"{r['cellc_s'] * 1e6:.1f}", f"`cellc bench` {r['bench_s'] * 1e6:.1f}",
                         f"the Python layer adds **{r['overhead_us']:.1f} µs**"])
    if body:
        out += table(["call", "threads", "cellc.RNN (µs)", "the other (µs)", "ratio"], body)
    return out


def python_summary(sources):
    """Per machine, cell and kind: the spread of the ratios; then training at B >= 16."""
    body, train = [], []
    for src in sources:
        d = load(src)
        cpu = d["meta"]["cpu"]
        rows = [r for r in d["rows"] if r["kind"] in ("varlen", "full")]
        for cell in dict.fromkeys(r["cell"] for r in rows):
            for kind, what in (("varlen", "lengths varying (T=100)"), ("full", "full length (T=35 and 100)")):
                ratios = [r["ratio"] for r in rows if r["cell"] == cell and r["kind"] == kind]
                body.append([cpu, cell, what, len(ratios), r2(min(ratios)), r2(statistics.median(ratios)),
                             r2(max(ratios)), sum(x < 1.0 for x in ratios)])
            ratios = [r["ratio"] for r in rows if r["cell"] == cell and r["mode"] == "train" and r["batch"] >= 16]
            train.append([cpu, cell, len(ratios), r2(min(ratios)), r2(max(ratios)), sum(x >= 1.3 for x in ratios)])
    return header(sources) + table(
        ["processor", "cell", "lengths", "shapes", "min", "median", "max", "below 1.0"], body) + [
        "Training at B >= 16, every kind of lengths (the target: 1.3x):", ""] + table(
        ["processor", "cell", "shapes", "min", "max", "at or above 1.3"], train)


def gen_python():
    files = {
        "python_xeon.md": python_tables("python_vs_nn.json"),
        "python_zen3.md": python_tables("python_vs_nn_zen3.json"),
        "python_summary.md": python_summary(["python_vs_nn.json", "python_vs_nn_zen3.json"]),
    }
    src = "python_vs_nn_dropout_zen3.json"
    d = load(src)
    body = [[r["mode"], f"{r['cellc_s'] * 1e3:.1f}", f"{r['nn_padded_s'] * 1e3:.1f}",
             f"{r['nn_packed_s'] * 1e3:.1f}", f"**{r2(r['ratio'])}**"] for r in d["rows"]]
    r0 = d["rows"][0]
    files["python_dropout.md"] = header([src]) + [
        f"`cellc.RNN(dropout={d['meta']['dropout']})` against `nn.LSTM(dropout={d['meta']['dropout']})`, "
        f"{d['meta']['layers']} layers, B={r0['batch']}, H=I={r0['hidden']}, T={r0['steps']}, lengths "
        f"uniform in [T/2, T], {r0['threads']} threads. Ratio: PyTorch's faster route / cellc.", ""] + table(
        ["mode", "cellc.RNN (ms)", "nn.LSTM padded (ms)", "nn.LSTM packed (ms)", "ratio"], body)

    src = "resets_speed_zen3.json"
    d = load(src)
    c = d["config"]
    names = list(d["ms"]["infer"])
    body = []
    for mode in ("infer", "train"):
        ms = d["ms"][mode]
        torch_best = min(v for k, v in ms.items() if k.startswith("nn."))
        body.append([mode] + [f"{ms[n]:.1f}" for n in names] + [
            r2(ms["cellc, resets"] / ms["cellc, no resets"]), f"**{r2(torch_best / ms['cellc, resets'])}**"])
    files["python_resets.md"] = header([src]) + [
        f"`benches/resets_speed.py`: an LSTM, B={c['batch']}, T={c['steps']}, H={c['hidden']}, an episode "
        f"ending every {c['episode']:g} steps on average ({c['resets']} resets in the batch), "
        f"{c['threads']} threads, {c['rounds']} alternating rounds, each route's fastest pass kept. "
        "Times in ms; the cost of resets is cellc's time with them over its time without; the last "
        "column is PyTorch's faster route over cellc with resets.", ""] + table(
        ["mode"] + names + ["cost of resets", "vs PyTorch"], body)

    src = "word_language_model.json"
    d = load(src)
    by = {r["model"]: r for r in d["rows"]}
    nn_, cc = by["nn.LSTM"], by["cellc.RNN"]
    fields = [("training, tokens/s", "train_tokens_per_s", "{:.0f}", True),
              ("training step (ms)", "train_step_ms", "{:.1f}", False),
              ("RNN forward per step (ms)", "rnn_forward_ms", "{:.1f}", False),
              ("RNN backward per step (ms)", "rnn_backward_ms", "{:.1f}", False),
              ("evaluation, tokens/s", "eval_tokens_per_s", "{:.0f}", True),
              ("evaluation, RNN per batch (ms)", "eval_rnn_ms_per_batch", "{:.2f}", False),
              ("generation, µs a word", "generate_us_per_word", "{:.0f}", False),
              ("validation loss", "val_loss", "{:.3f}", None)]
    body = []
    for label, key, fmt, higher in fields:
        ratio = "" if higher is None else r2(cc[key] / nn_[key] if higher else nn_[key] / cc[key])
        body.append([label, fmt.format(nn_[key]), fmt.format(cc[key]), ratio])
    files["python_word_lm.md"] = header([src]) + [
        f"PyTorch's `word_language_model` example, `nn.LSTM` against `cellc.RNN` from the same "
        f"weights, alternating, {d['threads']} threads, dropout {d['dropout']}. The last column is "
        "cellc's speed over PyTorch's (above 1: cellc is faster).", ""] + table(
        ["", "nn.LSTM", "cellc.RNN", "cellc / nn"], body)

    src = "module_comparison.json"
    rows = [r for r in load(src) if "steps" not in r]
    out = header([src]) + [
        "`benches/compare_pytorch_module.py`, T=100, I=H, lengths uniform in [T/2, T]: PyTorch time / "
        "`cellc.RNN` time against `nn.LSTM`'s faster route (bold) / the TorchScript cell / the eager "
        "loop; then the milliseconds the Python layer added per call over `cellc bench`.", ""]
    for cell in dict.fromkeys(r["cell"] for r in rows):
        mine = [r for r in rows if r["cell"] == cell]
        cols = list(dict.fromkeys((r["mode"], r["threads"]) for r in mine))
        body = []
        for b, h in shapes(mine):
            line = [b, h]
            for m, t in cols:
                r = pick(mine, batch=b, hidden=h, mode=m, threads=t)
                line.append(f"**{r2(r['nn_ratio'])}** / {r['torchscript_ratio']:.1f} / {r['loop_ratio']:.1f}; "
                            f"+{max(r['overhead_us'], 0) / 1e3:.2f}")
            body.append(line)
        out += [f"**{cell}**", ""] + table(["B", "H"] + [col_name(m, t) for m, t in cols], body)
    files["python_module.md"] = out
    return files


# ---- The main job: benches/charlm_side_by_side.py ---------------------------------------------

def gen_charlm():
    sources = ["charlm_side_by_side_zen5.json", "charlm_side_by_side.json"]
    body = []
    for src in sources:
        d = load(src)
        date = provenance(src, d)[1].split(" ")[0]
        cpu = d["machine"].split(", ", 1)[1]
        for cell, c in d["cells"].items():
            med = c.get("median", c)  # an older file keeps layernorm_lstm's medians at the top
            padded = med.get("pytorch_padded", med["pytorch"])
            packed = med.get("pytorch_packed")
            vendor = "TorchScript cell" if cell == "layernorm_lstm" else f"`nn.{cell.upper()}`"
            torch_text = f"{padded / 1e3:.1f}k ({vendor})" + (f", {packed / 1e3:.1f}k" if packed else "")
            body.append([cell, cpu, date, f"{med['charlm'] / 1e3:.1f}k", torch_text, f"**{r2(c['ratio'])}**"])
        steps = next(iter(d["cells"].values()))["steps"]
    return {"charlm.md": header(sources) + [
        f"`charlm` against PyTorch on the same batches, {steps} steps, medians of 3 rounds, 2 "
        "threads, H=256, embedding 64, batches of 32 verses. The ratio is charlm's tokens/s over "
        "PyTorch's faster route.", ""] + table(
        ["cell", "processor", "date", "charlm tokens/s", "PyTorch tokens/s: padded, packed",
         "ratio"], body)}


# ---- Mixed precision: benches/bf16_speed.py ---------------------------------------------------

def gen_bf16():
    files = {}
    for src, name in (("bf16_speed_xeon_amx.json", "bf16_xeon_amx.md"), ("bf16_speed_xeon.json", "bf16_xeon.md"),
                      ("bf16_speed_zen3.json", "bf16_zen3.md")):
        d = load(src)
        body = []
        for r in d["rows"]:
            ms = r["ms"]
            routes = {k.rsplit(" ", 1)[1]: v for k, v in ms.items() if k.startswith("torch bf16")}
            if routes:
                best = min(routes, key=routes.get)
                torch_bf16 = f"{routes[best]:.1f} ms ({best})"
            else:
                torch_bf16 = "fails (oneDNN)"
            vs_bf16 = r.get("cellc_bf16_vs_torch_bf16_faster")
            body.append([r["cell"], r["B"], r["H"], r["mode"], f"{ms['cellc bf16']:.1f} ms",
                         f"{ms['cellc f32']:.1f} ms", torch_bf16, f"{ms['torch f32 padded']:.1f} ms",
                         f"{r['cellc_bf16_vs_cellc_f32']:.2f}x",
                         f"{vs_bf16:.2f}x" if vs_bf16 is not None else "n/a",
                         f"{r['cellc_bf16_vs_torch_f32']:.2f}x"])
        # The JSON keeps the error's first 160 characters; its first sentence says it all.
        errors = sorted({e.split(". ")[0] for r in d["rows"] for e in r["errors"].values()})
        flags = ", ".join(d["cpu_bf16_flags"]) or "none"
        out = header([src], f" bf16 flags of the processor: {flags}; {d['threads']} threads.") + [
            "T=100, I=H, every sequence full length. `layernorm_lstm`'s PyTorch columns are `nn.LSTM`'s "
            "(PyTorch has no fused LayerNorm-LSTM: the vendor's speed). Ratios are times divided, the "
            "other route's over cellc bf16's (above 1: cellc bf16 is faster).", ""] + table(
            ["cell", "B", "H", "mode", "cellc bf16", "cellc f32", "PyTorch bf16 autocast (faster route)",
             "PyTorch f32 (padded)", "bf16 / cellc f32", "bf16 / PyTorch bf16", "bf16 / PyTorch f32"], body)
        if errors:
            out += ["PyTorch's error: " + "; ".join(f"\"{e}\"" for e in errors), ""]
        files[name] = out
    return files


# ---- sLSTM: benches/slstm_speed.py ------------------------------------------------------------

def gen_slstm():
    src = "slstm_speed_xeon.json"
    d = load(src)
    body = []
    for r in d["rows"]:
        body.append([r["hidden"], r["batch"], r["mode"], f"{r['xlstm_vanilla_ms']:.1f}", f"{r['cellc_dense_ms']:.2f}",
                     f"{r['cellc_heads_ms']:.2f}", f"**{r['speedup_vs_vanilla']:.1f}x**",
                     f"**{r['speedup_vs_dense']:.2f}x**", f"{r['max_abs_output_diff']:.1e}"])
    r0 = d["rows"][0]
    return {"slstm.md": header([src], f" {d['threads']} threads.") + [
        f"float32, {r0['heads']} heads, T={r0['steps']}; medians. `dense`: the same cell with one dense "
        "`[4H, H]` recurrent matrix.", ""] + table(
        ["H", "B", "mode", "xlstm vanilla (ms)", "cellc dense (ms)", "cellc heads (ms)", "heads vs vanilla",
         "heads vs dense", "largest output difference"], body)}


def gen_fused_step():
    src = "fused_step_zen5.json"
    d = load(src)
    body = [[r["cell"], r["batch"], r["hidden"], r.get("mode", "infer"), f"{r['fused_s'] * 1e3:.3f}",
             f"{r['unfused_s'] * 1e3:.3f}", f"**{r['ratio']:.2f}x**"] for r in d["rows"]]
    meta = d["meta"]
    return {"cpu_fused_step.md": header([src], f" {meta['threads']} threads.") + [
        f"T={d['rows'][0]['steps']}, every sequence full length; medians of {meta['rounds']} "
        "alternating rounds of `cellc bench` and `cellc bench --unfused`; ratio = unfused time / fused time.",
        ""] + table(["cell", "B", "H", "mode", "fused (ms)", "unfused (ms)", "ratio"], body)}


#: The export benchmark's runs, by machine: (results file, the table's short name for it).
EXPORT_RUNS = [("export_speed_xeon_amx.json", "Xeon, AMX"), ("export_speed_zen5.json", "Zen 5")]


def gen_export():
    body = []
    for src, machine in EXPORT_RUNS:
        for r in load(src)["rows"]:
            body.append([machine, r["batch"], f"{r['cellc_ms']:.3f}", f"{r['package_ms']:.3f}",
                         f"**{r['package_over_cellc']:.3f}**", f"{r['onnx_node_ms']:.3f}",
                         f"**{r['onnx_node_over_cellc']:.3f}**", f"{r['nn.LSTM_ms']:.3f}", f"{r['ort_lstm_ms']:.3f}",
                         f"{r['max_abs_diff']:.1e}"])
    r0 = load(EXPORT_RUNS[0][0])["rows"][0]
    return {"export.md": header([src for src, _ in EXPORT_RUNS], f" {r0['threads']} threads.") + [
        f"An LSTM, H={r0['hidden']}, T={r0['steps']}, inference, float32; medians, alternating "
        "(`benches/export_speed.py`). Ratios: exported time / eager `cellc.RNN` time.", ""] + table(
        ["machine", "B", "cellc.RNN eager (ms)", "AOTInductor package (ms)", "package / eager",
         "ONNX Runtime node (ms)", "node / eager", "nn.LSTM eager (ms)", "ONNX Runtime's LSTM (ms)",
         "largest difference"], body)}


# ---- GPU: tests/gpu/check.py ------------------------------------------------------------------

# Shorter names for runs whose JSON note is a sentence.
GPU_LABELS = {
    "python_with_graphs_and_tables":
        "each value's home looked up once per pointer table (another H100 of the same kind)",
}


def minute(date):
    """An ISO date and time, to the minute (the checks record UTC)."""
    return date[:16].replace("T", " ")


def when(run):
    return minute(run["device"]["date"])


def commit(run):
    return f"`{run['manifest']['commit'][:7]}`"


def gpu_runs(d):
    """The checks a GPU results file records, each a dict as `tests/gpu/check.py` writes it,
    oldest first: the runs it holds by name, or the file itself where it is one run."""
    runs = [v for v in d.values() if isinstance(v, dict) and "steps" in v and "device" in v]
    if not runs and "steps" in d and "device" in d:
        runs = [d]
    return sorted(runs, key=lambda run: run["device"]["date"])


def gpu_sources():
    """The GPU checks' results files (`gpu_check*.json`): one file of many runs (the first
    checks), then one file per check as check.py wrote its results.json."""
    return {n: load(n) for n in sorted(os.listdir(RESULTS)) if n.startswith("gpu_check") and n.endswith(".json")}


def ratio_line(rows, b):
    out = []
    for cell in ("lstm", "gru"):
        for mode in ("infer", "train"):
            r = [r for r in rows if (r["cell"], r["mode"], r["batch"]) == (cell, mode, b)]
            out.append(r2(r[0]["ratio"]) if r and r[0].get("ratio") is not None else "-")
    return out


def history_rows(run):
    """A realistic-grid run's rows of the first checks' shape: cellc.RNN on CUDA tensors, float32,
    H=256, T=100."""
    return [r for r in run.get("speed", []) if (r["source"], r["precision"], r["hidden"], r["steps"]) ==
            ("python", "f32", 256, 100)]


def gen_gpu(sources=None):
    """The GPU page's tables from `sources` (name -> JSON; default: every gpu_check*.json)."""
    sources = gpu_sources() if sources is None else sources
    names = list(sources)
    files = {}
    runs = sorted((run for d in sources.values() for run in gpu_runs(d)), key=lambda run: run["device"]["date"])
    head = lambda extra="": header(names, extra, sources)  # noqa: E731

    body = []
    for run in runs:
        steps = run["steps"]
        passed = sum(s["status"] == "passed" for s in steps.values())
        seconds = sum(s["seconds"] for s in steps.values())
        dirty = " (uncommitted changes)" if run["manifest"]["uncommitted_changes"] else ""
        body.append([when(run), commit(run) + dirty, run["device"].get("name", "-"),
                     f"{passed} of {len(steps)}: {' '.join(steps)}", f"{seconds:.0f}"])
    files["gpu_checks.md"] = head() + [
        "Every GPU check recorded (`tests/gpu/check.py`), dates in UTC:", ""] + table(
        ["date", "commit", "device", "steps passed", "seconds (sum of the steps)"], body)

    # The latest full check: its steps.
    full = [run for run in runs if "compare" in run or "speed" in run]
    if full:
        last = full[-1]
        out = head() + [f"The latest full check, {when(last)} UTC, commit {commit(last)}, "
                        f"{last['device'].get('name', '-')}, driver {last['device'].get('driver', '-')}:", ""]
        out += table(["step", "status", "s", "note"],
                     [[name, s["status"], f"{s['seconds']:.1f}", s["note"]] for name, s in last["steps"].items()])
        files["gpu_latest_steps.md"] = out

    # The realistic grid: the latest check that measured it.
    grid_runs = [run for run in runs if run.get("speed")]
    if grid_runs:
        files["gpu_grid.md"] = head() + report.speed_report(grid_runs[-1])
    else:
        files["gpu_grid.md"] = head()[:2] + [
            "No GPU has run the realistic grid yet: the check's `speed` step (H 256 to 1024, B 1 to 256, T 100 "
            "and 1000, in f32, TF32, bf16 and fp16) runs on the next GPU lent. Its dry run on the emulated "
            "device runs in CI.", ""]

    # The first checks' tables, at T=100, H=256, float32.
    old = [run for run in runs if "python" in run]
    if old:
        files["gpu_latest.md"] = gpu_first_checks(old[-1], head)
        files["gpu_bench.md"] = gpu_host_memory(runs, head)

    # Every recorded run's ratios to cuDNN, LSTM and GRU, B=1 and B=64.
    lines = []
    for run in runs:
        if "python" in run:
            lines.append((when(run), f"`cellc.RNN` on CUDA tensors, graphs (check at {commit(run)})", run["python"]))
        if "compare" in run:
            rows = [r for r in run["compare"] if r["graphs"]]
            lines.append((when(run), f"`cellc bench` (host memory), graphs (check at {commit(run)})", rows))
        if history_rows(run):
            lines.append((when(run), f"`cellc.RNN` on CUDA tensors, graphs, the realistic grid's rows (check at "
                                     f"{commit(run)}, {run['device'].get('name', '-')})", history_rows(run)))
    for d in sources.values():
        for k, v in d.items():  # single steps run on their own, with a note
            # (a check's own keys, such as `grid_from`, which names the earlier check it carried rows
            # from, are not such steps)
            if isinstance(v, dict) and "steps" not in v and "date" in v and ("graphs" in v or "note" in v):
                date = minute(v["date"])
                if "graphs" in v:
                    lines.append((date, "`cellc.RNN` on CUDA tensors, graphs, same call as the next row", v["graphs"]))
                    lines.append((date, "`cellc.RNN` on CUDA tensors, no graphs", v["no_graphs"]))
                elif "rows" in v:
                    what = GPU_LABELS.get(k, v["note"])
                    lines.append((date, f"`cellc.RNN` on CUDA tensors, graphs, {what}", v["rows"]))
    lines.sort(key=lambda line: line[0])
    body = [[date, what, f"B={b}"] + ratio_line(rows, b) for date, what, rows in lines for b in (1, 64)]
    files["gpu_history.md"] = head() + [
        "PyTorch's faster route (cuDNN) / cellc in every recorded run, T=100, H=256, TF32 off (above 1: "
        "cellc is faster). Dates in UTC.", ""] + table(
        ["date", "what", "B", "LSTM infer", "LSTM train", "GRU infer", "GRU train"], body)
    return files


def gpu_first_checks(last, head):
    """The latest check of the first format: cellc.RNN and `cellc bench` at T=100, H=256."""
    def torch_text(r):
        return ", ".join(f"{k} {v:.3f}" for k, v in r["torch_ms"].items())

    out = head() + [
        f"The latest check at the first checks' shape ({last['device']['date'][:10]}, "
        f"{last['device']['name']}, driver {last['device']['driver']}): `cellc.RNN` on CUDA tensors, from "
        "Python, graphs on (the default). T=100, H=256, lengths uniform in [50, 100], TF32 off; ratio: "
        "PyTorch's faster route / cellc.", ""]
    out += table(["cell", "mode", "B", "cellc ms", "PyTorch ms (route)", "ratio"],
                 [[r["cell"], r["mode"], r["batch"], f"{r['cellc_ms']:.3f}", torch_text(r), f"**{r2(r['ratio'])}**"]
                  for r in last["python"]])
    out += ["`cellc bench` (host memory) in the same check, with and without CUDA graphs; "
            "layernorm_lstm against its TorchScript cell:", ""]
    out += table(["cell", "mode", "B", "graphs", "cellc ms", "PyTorch ms (route)", "ratio"],
                 [[r["cell"], r["mode"], r["batch"], "yes" if r["graphs"] else "no",
                   f"{r['cellc_ms']:.3f}" if r["cellc_error"] is None else r["cellc_error"], torch_text(r),
                   f"**{r2(r['ratio'])}**"] for r in last["compare"]])
    return out


def gpu_host_memory(runs, head):
    """`cellc bench` (host memory) at B=64 in each check of the first format."""
    body = []
    for run in runs:
        if "compare" not in run:
            continue
        ms = {(r["mode"], r["graphs"]): r["cellc_ms"] for r in run["compare"]
              if (r["cell"], r["batch"]) == ("lstm", 64)}
        order = (("infer", False), ("infer", True), ("train", False), ("train", True))
        body.append([when(run), commit(run), run["device"]["name"]] + [f"{ms[k]:.1f}" for k in order])
    out = head() + [
        "`cellc bench --backend cuda` (host memory), LSTM, B=64, H=256, T=100, lengths uniform in [50, 100], "
        "in each check's compare step (ms):", ""] + table(
        ["date", "commit", "device", "infer", "infer, graphs", "train", "train, graphs"], body)
    body = []
    for run in runs:
        sb = run.get("smoke_bench_ms")
        if sb:
            order = ("infer", "infer+graphs", "train", "train+graphs")
            body.append([when(run), commit(run), run["device"].get("name", "-")] + [f"{sb[k]:.2f}" for k in order])
    shape = next(run["smoke_bench_ms"]["shape"] for run in runs if "smoke_bench_ms" in run)
    out += [f"The smoke step's `cellc bench`, {shape}, lengths uniform in [T/2, T] (ms):", ""] + table(
        ["date", "commit", "device", "infer", "infer, graphs", "train", "train, graphs"], body)
    return out


# ---- The sources ------------------------------------------------------------------------------

PAGES = {
    "full_comparison.json": "CPU against PyTorch", "masks_speed_zen3.json": "CPU against PyTorch",
    "python_vs_nn.json": "From Python", "python_vs_nn_zen3.json": "From Python",
    "python_vs_nn_dropout_zen3.json": "From Python", "resets_speed_zen3.json": "From Python",
    "word_language_model.json": "From Python", "module_comparison.json": "From Python",
    "charlm_side_by_side.json": "The main job", "charlm_side_by_side_zen5.json": "The main job",
    "bf16_speed_xeon.json": "Mixed precision", "bf16_speed_zen3.json": "Mixed precision",
    "bf16_speed_xeon_amx.json": "Mixed precision",
    "slstm_speed_xeon.json": "sLSTM heads", "fused_step_zen5.json": "CPU against PyTorch",
    "export_speed_xeon_amx.json": "Deploying a model", "export_speed_zen5.json": "Deploying a model",
}


def gen_sources():
    body = []
    for name in sorted(f for f in os.listdir(RESULTS) if f.endswith(".json")):
        if name in NOT_SHOWN:
            body.append([f"`{name}`", "", "", NOT_SHOWN[name]])
            continue
        machine, date, _ = provenance(name, load(name))
        page = "GPU" if name.startswith("gpu_check") else PAGES.get(name, "not shown")
        body.append([f"`{name}`", machine, date, page])
    return {"sources.md": [
        "<!-- Written by docs/gen_perf.py from benches/results/*.json: do not edit; run python3 "
        "docs/gen_perf.py. -->", ""] + table(["results", "machine", "date", "shown in"], body)}


def generate():
    files = {}
    for part in (gen_cpu, gen_masks, gen_python, gen_charlm, gen_bf16, gen_slstm, gen_fused_step, gen_export,
                 gen_gpu, gen_sources):
        files.update(part())
    return {name: "\n".join(lines).rstrip("\n") + "\n" for name, lines in files.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; fail if a table is stale")
    ap.add_argument("--gpu-results", metavar="RESULTS_JSON",
                    help="write nothing; print the GPU page's tables as this one check's results.json would give "
                         "them (the GPU check's dry run in CI renders its own)")
    args = ap.parse_args()
    if args.gpu_results:
        with open(args.gpu_results) as f:
            files = gen_gpu({os.path.basename(args.gpu_results): json.load(f)})
        for name, lines in files.items():
            print(f"==> {name}\n" + "\n".join(lines))
        return
    files = generate()
    present = {f for f in os.listdir(TABLES) if f.endswith(".md")} if os.path.isdir(TABLES) else set()
    if args.check:
        stale = []
        for name, text in sorted(files.items()):
            try:
                with open(os.path.join(TABLES, name), encoding="utf-8") as f:
                    if f.read() != text:
                        stale.append(f"{name} (differs)")
            except FileNotFoundError:
                stale.append(f"{name} (missing)")
        stale += [f"{name} (no results write it)" for name in sorted(present - set(files))]
        if stale:
            rel = os.path.relpath(TABLES, ROOT)
            sys.exit(f"stale performance tables in {rel}: {', '.join(stale)}; run python3 docs/gen_perf.py")
        print(f"{len(files)} performance tables up to date")
        return
    os.makedirs(TABLES, exist_ok=True)
    for name in sorted(present - set(files)):
        os.remove(os.path.join(TABLES, name))
    for name, text in sorted(files.items()):
        with open(os.path.join(TABLES, name), "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    print(f"wrote {len(files)} tables to {os.path.relpath(TABLES, ROOT)}")


if __name__ == "__main__":
    main()
