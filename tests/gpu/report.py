"""Tables of a GPU check's speed rows (the `speed` list of its results.json), in Markdown: the
one renderer of them, for the check's summary.md and for the book's GPU page
(docs/gen_perf.py). Standard library only.

Every table opens with the device, its driver and the date of the check. Ratios are PyTorch's
time over cellc's (above 1: cellc is faster): against PyTorch's faster route of the same cell
(cuDNN's nn.LSTM or nn.GRU, padded or packed); for the LayerNorm-LSTM against the vendor's plain
nn.LSTM (its faster route) and against its TorchScript cell.
"""

PRECISION_TEXT = {
    "f32": "float32, TF32 off on both sides",
    "tf32": "float32 with TF32 on (both sides: cuDNN's RNN and cuBLAS, and cellc's products)",
    "bf16": "bf16 autocast (cuDNN's half-precision RNN against cellc's bf16 products on the tensor cores)",
    "f16": "fp16 autocast (cuDNN's half-precision RNN against cellc's fp16 products on the tensor cores)",
}
ORDER = ("f32", "tf32", "bf16", "f16")


def device_line(run):
    """*device, driver, date, commit, and Python, PyTorch and CUDA versions*, in italics."""
    d = run.get("device", {})
    parts = [d.get("name") or ("the emulated device (no GPU)" if run.get("emulated") else "no GPU"),
             f"driver {d.get('driver', '-')}", d.get("date", "")[:16].replace("T", " ") + " UTC"]
    commit = run.get("manifest", {}).get("commit", "")[:7]
    if commit:
        parts.append(f"commit `{commit}`")
    if d.get("python_torch_cuda"):
        parts.append(f"Python, PyTorch, CUDA, GPU seen: {d['python_torch_cuda']}")
    return "*" + ", ".join(parts) + "*"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def ms(x):
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def ratio(x):
    return "-" if x is None else f"**{x:.2f}**"


def err(e):
    if not e:
        return "-"
    parts = [f"{e['output']:.1e}"] + ([f"{e['grads']:.1e}"] if "grads" in e else [])
    return " / ".join(parts)


def shape_key(r):
    return (r["cell"], r["steps"], r["hidden"], r["batch"], r["mode"])


def rows_of(run, source):
    return [r for r in run.get("speed", []) if r["source"] == source]


def python_tables(run):
    """One table per precision of cellc.RNN on CUDA tensors against PyTorch, with errors."""
    rows = rows_of(run, "python")
    out = []
    for precision in ORDER:
        mine = sorted((r for r in rows if r["precision"] == precision), key=shape_key)
        if not mine:
            continue
        out += [f"**{precision}**: {PRECISION_TEXT[precision]}. {device_line(run)}", ""]
        body = []
        for r in mine:
            torch = r.get("torch_ms") or {}
            best = r.get("torch_best")
            routes = ", ".join(f"{k} {ms(v)}" for k, v in torch.items())
            failed = ", ".join(f"{k} ({v.split(':')[0]})" for k, v in (r.get("torch_failed") or {}).items())
            e = r.get("errors") or {}
            status = r["status"] if r["status"] != "measured" else ""
            body.append([r["cell"], r["batch"], r["hidden"], r["steps"], r["mode"],
                         ms(r["cellc_ms"]) if r["cellc_ms"] is not None else f"failed: {r.get('cellc_error')}",
                         routes + (f" (failed: {failed})" if failed else ""), best or "-", ratio(r.get("ratio")),
                         ratio(r.get("ratio_torchscript")) if r["cell"] == "layernorm_lstm" else "",
                         err(e.get("cellc")), err(e.get("torch")) + (f" ({e['torch_route']})" if e.get("torch_route") else ""),
                         status])
        out += table(["cell", "B", "H", "T", "mode", "cellc ms", "PyTorch ms (route)", "faster route", "ratio",
                      "vs TorchScript", "cellc error (out / grads)", "PyTorch error", "status"], body)
    return out


def bench_table(run):
    """`cellc bench` (host memory, CUDA graphs) against the same PyTorch times."""
    rows = sorted(rows_of(run, "bench"), key=lambda r: (ORDER.index(r["precision"]),) + shape_key(r))
    if not rows:
        return []
    body = [[r["cell"], r["precision"], r["batch"], r["hidden"], r["steps"], r["mode"],
             ms(r["cellc_ms"]) if r["cellc_ms"] is not None else f"failed: {r.get('cellc_error')}",
             ", ".join(f"{k} {ms(v)}" for k, v in (r.get("torch_ms") or {}).items()), ratio(r.get("ratio")),
             ratio(r.get("ratio_torchscript")) if r["cell"] == "layernorm_lstm" else ""] for r in rows]
    return [f"`cellc bench --backend cuda --cuda-graphs` (the batch on the host, uploads and downloads "
            f"included) against the Python rows' PyTorch times. {device_line(run)}", ""] + table(
        ["cell", "precision", "B", "H", "T", "mode", "cellc ms", "PyTorch ms (route)", "ratio", "vs TorchScript"], body)


def profile_table(run):
    """Per shape class: GPU operations per step, how busy the GPU is, and where its time goes."""
    rows = rows_of(run, "profile")
    if not rows:
        return []
    body = []
    for r in rows:
        for who in ("cellc", "torch"):
            p = r.get(who) or {}
            if "error" in p:
                body.append([r["label"], r["cell"], r["mode"], r["precision"], who, f"failed: {p['error']}"] + [""] * 6)
                continue
            step = p.get("us_per_step", {})
            body.append([r["label"], f"{r['cell']} (B={r['batch']} H={r['hidden']} T={r['steps']})", r["mode"],
                         r["precision"], "cellc" if who == "cellc" else "nn.LSTM (padded)",
                         f"{p.get('wall_ms', 0):.2f}", f"{p.get('gpu_busy_ms', 0):.2f}",
                         f"{100 * p.get('busy_fraction', 0):.0f}%", f"{p.get('gpu_ops_per_step', 0):.1f}",
                         f"{step.get('product', 0):.1f}", f"{step.get('pointwise', 0):.1f}",
                         f"{step.get('copy', 0):.1f}"])
    return [f"torch.profiler per shape class (5 calls): wall and GPU-busy time of a call, GPU operations "
            f"per step, and the GPU's µs per step in products (cuBLAS), pointwise kernels (cellc's "
            f"step kernels; cuDNN's element-wise and persistent RNN kernels) and copies. "
            f"{device_line(run)}", ""] + table(
        ["class", "cell", "mode", "precision", "who", "wall ms", "GPU busy ms", "busy", "GPU ops/step",
         "product µs/step", "pointwise µs/step", "copy µs/step"], body)


def counts(run):
    """A line of how many rows of each status the speed step recorded."""
    rows = run.get("speed", [])
    by = {}
    for r in rows:
        by[r["status"]] = by.get(r["status"], 0) + 1
    return f"{len(rows)} speed rows: " + ", ".join(f"{n} {s}" for s, n in sorted(by.items()))


def speed_report(run):
    """Every table of a run's speed rows, or nothing where it has none."""
    if not run.get("speed"):
        return []
    head = [counts(run), ""]
    carried = run.get("grid_from")
    if carried and carried.get("rows"):
        head += [f"{carried['rows']} of these rows were carried from an earlier check ({carried.get('device') or 'emulated device'}, "
                 f"{carried.get('date')}, commit `{str(carried.get('commit'))[:7]}`, `{carried.get('file')}`), "
                 "judged again by this check's rule; the rest were measured by this one.", ""]
    return head + python_tables(run) + bench_table(run) + profile_table(run)
