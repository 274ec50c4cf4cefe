"""The GPU check's speed rows, measured: `cellc.RNN` on CUDA tensors (graphs on, as users get
it) and `cellc bench` against PyTorch's faster route, in each precision, with every output's
error against float64 on the same inputs; and profiles of where a call's time goes.

Imported by check.py in the process that has PyTorch and the pack's `cellc` package. On the
emulated device the same code runs on CPU tensors (`cuda-emulated`), at tiny sizes.

Precisions (`precision_context`):

- `f32`: float32 with TF32 off on both sides (`torch.backends.cuda.matmul.allow_tf32` and
  `torch.backends.cudnn.allow_tf32` False; cellc.RNN follows cuDNN's switch);
- `tf32`: both switches on: cuDNN's RNN and cuBLAS round the products' operands to TF32, and so
  does cellc.RNN, which follows cuDNN's RNN switch;
- `bf16`, `f16`: TF32 off, under `torch.autocast` with that dtype: cuDNN's half-precision RNN,
  cellc's bf16 or fp16 products on the tensor cores.

Errors: every row runs cellc and PyTorch's route of the same function (nn.LSTM/nn.GRU padded;
the LayerNorm-LSTM's TorchScript cell) on the same inputs and weights as one float64 reference,
computed once per unit (in chunks of the batch where memory asks: the loss is a sum over
sequences, so chunks' gradients add up to the batch's). The output's error is the largest
|y - y64| over the sequences' steps, over max(1, max |y64|); in training, the gradients' error is
the largest ||g - g64|| / ||g64|| over the input's and every weight's. A row is `wrong` where
cellc's error exceeds both its precision's floor and four times PyTorch's own. Where no PyTorch
route of the same function is timed in a precision (the LayerNorm-LSTM's TorchScript cell at
T=1000 in tf32 and f16), PyTorch's float32 error on the same inputs stands in: no lower precision
does better, and on a shape whose float64 reference float32 itself cannot follow (a chaotic
LayerNorm-LSTM over 1000 steps: PyTorch's f32 output error 1.8 on an H200) a half-precision floor
would call every implementation wrong.
"""
import contextlib
import copy
import json
import math
import os
import re
import statistics
import subprocess
import time

import torch
import torch.nn as nn

import cellc
import compare_pytorch as cp
import grid

TORCH = {"lstm": nn.LSTM, "gru": nn.GRU}
HALF = {"bf16": torch.bfloat16, "f16": torch.float16}
# (output, gradients): the error past which cellc is wrong whatever PyTorch's own error.
FLOOR = {"f32": (1e-3, 1e-3), "tf32": (2e-2, 5e-2), "f16": (2e-2, 5e-2), "bf16": (1e-1, 2e-1)}
TIMES_PYTORCH_ERROR = 4.0
LONG_CALL = 1.0  # seconds: two timed calls suffice past this much timing
STEP_LOOP_MAX_ROWS = 64  # step_loop::AUTO_MAX_ROWS: the widest step the default runs as a step loop
# The float64 reference's memory per sequence and step per unit of H, in bytes (training; an
# eager LayerNorm-LSTM loop keeps about 56 H-sized float64 values per step for autograd).
REFERENCE_BYTES = {"layernorm_lstm": 56 * 8, "lstm": 12 * 8, "gru": 10 * 8}


class Measure:
    """Measurements on `device` ("cuda", or "cpu" for the emulated device) with cellc's
    `backend` ("cuda" or "cuda-emulated"); `min_time`: the least seconds a route is timed;
    `cellc_bench`: the path of the `cellc` binary; `reference_chunk`: sequences per chunk of the
    float64 reference (None: as many as a third of the free device memory holds)."""

    def __init__(self, device, backend, min_time, cellc_bench, cells_dir, reference_chunk=None):
        self.device, self.backend, self.min_time = device, backend, min_time
        self.cellc_bench, self.cells_dir = cellc_bench, cells_dir
        self.reference_chunk = reference_chunk

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    # ---- a unit: one cell, shape and mode, in each of its precisions ---------------------------

    def unit(self, unit, recorded):
        """Yields the unit's rows (each a dict as results.json keeps it) one at a time, leaving
        out those `recorded` (key -> row) holds already."""
        want = [p for p in unit.precisions if unit.key("python", p) not in recorded]
        bench = [p for p in unit.bench if unit.key("bench", p) not in recorded]
        if not want and not bench:
            return
        started = time.monotonic()
        setup = Setup(self, unit)
        reference = Reference(setup) if want else None
        f32_torch_error = torch_errors(recorded.get(unit.key("python", "f32")))
        for precision in unit.precisions:
            if precision in want:
                row = self.python_row(unit, setup, reference, precision, f32_torch_error)
                if precision == "f32":
                    f32_torch_error = row["errors"]["torch"]
                row["seconds"] = round(time.monotonic() - started, 2)
                yield row
                started = time.monotonic()
            if precision in bench:
                python = recorded.get(unit.key("python", precision)) or row
                yield self.bench_row(unit, precision, python["torch_ms"])
                started = time.monotonic()
        setup.release()

    def python_row(self, unit, setup, reference, precision, f32_torch_error=None):
        """cellc.RNN and PyTorch's routes at the unit's shape in `precision`, and their errors;
        `f32_torch_error`: PyTorch's errors in f32 on the same inputs, where measured (`judge`)."""
        row = base_row("python", unit.cell, unit.shape, unit.mode, precision, unit.tier)
        ms, errors, failures = {}, {}, {}
        for name, route in setup.routes(precision).items():
            with precision_context(precision, self.device):
                try:
                    seconds, out, grads = self.time_route(route, unit.mode, setup)
                except Exception as e:  # a route PyTorch cannot run in this precision, or memory
                    failures[name] = short(e)
                    release()
                    continue
            ms[name] = seconds * 1e3
            if route.checked:
                errors[name] = reference.errors(out, grads)
            del out, grads
        row.update(cellc_ms=ms.pop("cellc", None), cellc_error=failures.pop("cellc", None),
                   torch_ms=ms, torch_failed=failures)
        ours, theirs = errors.pop("cellc", None), next(iter(errors.values()), None)
        row["errors"] = {"cellc": ours, "torch": theirs, "torch_route": next(iter(errors), None)}
        judge(row, ours, theirs, precision, f32_torch_error)
        add_ratios(row, unit.cell)
        return row

    def time_route(self, route, mode, setup):
        """(median seconds of a call, the last call's output, and its gradients, the input's
        then each weight's, where the route's error is checked in training; else None)."""
        once = setup.call(route, mode)
        for _ in range(route.warmups):  # kernels compiled, graphs captured, cuDNN's plans made
            once()
        self.sync()
        times, started = [], time.perf_counter()
        while True:
            t0 = time.perf_counter()
            out = once()
            self.sync()
            times.append(time.perf_counter() - t0)
            spent = time.perf_counter() - started
            if len(times) >= 1000 or (len(times) >= 3 and spent >= self.min_time) or \
                    (len(times) >= 2 and spent >= LONG_CALL):
                break
        grads = None
        if mode == "train" and route.checked:
            grads = [setup.x.grad.detach().clone()] + [p.grad.detach().clone() for p in route.params]
        return statistics.median(times), out.detach(), grads

    def bench_row(self, unit, precision, torch_ms):
        """`cellc bench` at the unit's shape: the runtime on host memory (uploads and downloads
        included), CUDA graphs on, against the Python row's PyTorch times."""
        started = time.monotonic()
        row = base_row("bench", unit.cell, unit.shape, unit.mode, precision, unit.tier)
        b, h, t = unit.shape.batch, unit.shape.hidden, unit.shape.steps
        cmd = [self.cellc_bench, "bench", os.path.join(self.cells_dir, f"{unit.cell}.cell"), "-D", f"H={h}",
               "-D", f"I={h}", "--batch", str(b), "--steps", str(t), "--lengths", "uniform", "--mode", unit.mode,
               "--min-time", str(self.min_time), "--json", "--backend", self.backend, "--dtype", precision,
               "--cuda-graphs"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            result = json.loads(r.stdout.strip().splitlines()[-1])
            row.update(cellc_ms=result["median_s"] * 1e3, compile_s=result["compile_s"], cellc_error=None)
        else:
            row.update(cellc_ms=None, cellc_error=last_line(r.stderr or r.stdout))
            row["status"] = "failed"
        # The time loop's other route, to validate the rule (runtime/src/backend/cuda/step_loop.rs:
        # a step loop up to 64 rows a step where the weights fit a block's shared memory, which
        # they do on an H100/H200 up to H=1024; step by step past 64 rows).
        row["route"] = "step loop" if b <= STEP_LOOP_MAX_ROWS else "step by step"
        other = "never" if b <= STEP_LOOP_MAX_ROWS else "always"
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CELLC_CUDA_STEP_LOOP": other})
        if r.returncode == 0:
            row["other_route_ms"] = json.loads(r.stdout.strip().splitlines()[-1])["median_s"] * 1e3
        else:
            row["other_route_error"] = last_line(r.stderr or r.stdout)
        row["torch_ms"] = torch_ms
        add_ratios(row, unit.cell)
        row.setdefault("status", "measured")
        row["seconds"] = round(time.monotonic() - started, 2)
        return row

    # ---- a profile -------------------------------------------------------------------------------

    def profile(self, task):
        """Where a call's time goes, for cellc and for PyTorch's padded nn.LSTM route (the
        vendor's plain LSTM, also for the LayerNorm-LSTM)."""
        from torch.profiler import ProfilerActivity, profile

        started = time.monotonic()
        row = base_row("profile", task.cell, task.shape, task.mode, task.precision, task.tier)
        row["label"] = task.label
        unit = grid.Unit(task.tier, task.cell, task.shape, task.mode, (task.precision,), ())
        setup = Setup(self, unit)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        routes = setup.routes(task.precision)
        for who, name in (("cellc", "cellc"), ("torch", "padded")):
            once = setup.call(routes[name], task.mode)
            with precision_context(task.precision, self.device):
                try:
                    row[who] = self.profiled(once, task.shape.steps, activities, profile)
                except Exception as e:
                    row[who] = {"error": short(e)}
                    release()
        setup.release()
        row["status"] = "failed" if "error" in row["cellc"] else "measured"
        row["seconds"] = round(time.monotonic() - started, 2)
        return row

    def profiled(self, once, steps, activities, profile):
        for _ in range(3):  # cellc's graphs captured; cuDNN's plans made
            once()
        self.sync()
        runs = 5
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(runs):
                once()
            self.sync()
            wall = (time.perf_counter() - started) / runs
        return kernel_breakdown(prof.key_averages(), runs, steps, wall)


class Route:
    """One way of running a unit's model: `fn()` gives its output; `params`: its weights in
    cellc.RNN's order (for the gradients' errors); `checked`: whether it computes the unit's
    function, so that its errors are measured; `warmups`: the calls before it is timed (cellc's
    CUDA graphs: a call run as it is, then one captured)."""

    def __init__(self, fn, params, checked, warmups=1):
        self.fn, self.params, self.checked, self.warmups = fn, params, checked, warmups


class Setup:
    """A unit's modules, input, lengths and loss weights, shared by its precisions."""

    def __init__(self, measure, unit):
        self.m, self.unit = measure, unit
        device = measure.device
        b, h, t = unit.shape.batch, unit.shape.hidden, unit.shape.steps
        torch.manual_seed(0)
        self.lengths = cp.lengths_uniform(b, t)
        self.lengths_t = torch.tensor(self.lengths)
        self.mask = (torch.arange(t)[None, :] < self.lengths_t[:, None]).to(device).unsqueeze(-1)
        train = unit.mode == "train"
        self.x = torch.randn(b, t, h, device=device, requires_grad=train)
        self.loss_weights = torch.randn(b, t, h, device=device) * self.mask
        self.rnn = cellc.RNN(unit.cell, h, h, batch_first=True, backend=measure.backend).to(device)
        if unit.cell == "layernorm_lstm":
            with torch.no_grad():  # gains and biases away from 1 and 0: their gradients matter
                for name, p in self.rnn.named_parameters():
                    if "layernorm" in name:
                        p.add_(0.1 * torch.randn_like(p))
            self.same = cp.LayerNormLSTMCell(h, h)
            load(self.same, self.rnn)
            self.same = self.same.to(device)
            self.script = torch.jit.script(self.same)
            self.vendor = nn.LSTM(h, h, batch_first=True).to(device)  # the vendor's plain LSTM
        else:
            self.same = TORCH[unit.cell](h, h, batch_first=True)
            load(self.same, self.rnn)
            self.same = self.same.to(device)
            self.vendor = self.same

    def call(self, route, mode):
        """One call of `route` in `mode`, as a user makes it: under no_grad in inference; in
        training, forward and backward of a weighted sum of the outputs (zero at padding), the
        gradients set afresh; returns the output."""
        x, weights = self.x, self.loss_weights

        def once():
            if mode == "infer":
                with torch.no_grad():
                    return route.fn()
            x.grad = None
            for p in route.params:
                p.grad = None
            out = route.fn()
            loss(out, weights).backward()
            return out
        return once

    def routes(self, precision):
        """The unit's routes in `precision`, by name: cellc, nn's padded and packed (the
        vendor's LSTM for the LayerNorm-LSTM), and the TorchScript cell where it is timed."""
        x, lengths, lengths_t = self.x, self.lengths, self.lengths_t
        rnn, vendor = self.rnn, self.vendor

        def packed():
            p = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return vendor(p)[0].data

        out = {"cellc": Route(lambda: rnn(x, lengths=lengths_t)[0], list(rnn.parameters()), True, warmups=2),
               "padded": Route(lambda: vendor(x)[0], ordered(vendor, rnn), vendor is self.same),
               "packed": Route(packed, ordered(vendor, rnn), False)}
        if grid.torchscript(self.unit.cell, self.unit.shape, precision):
            script = self.script
            out["torchscript"] = Route(lambda: cp.loop_over_time(script, x, lengths), ordered(self.same, rnn), True)
        return out

    def release(self):
        del self.rnn, self.same, self.vendor, self.x
        release()


class Reference:
    """The unit's float64 output and gradients (PyTorch's module of the same function, in float64,
    on the same inputs and weights), computed in chunks of the batch."""

    def __init__(self, setup):
        unit, m = setup.unit, setup.m
        train = unit.mode == "train"
        model = copy.deepcopy(setup.same).double()
        params = ordered(model, setup.rnn)
        x = setup.x.detach().double()
        g = setup.loss_weights.double()
        b = unit.shape.batch
        chunk = m.reference_chunk or self.chunk_size(unit, m.device)
        outs, grads_x = [], []
        grads_w = [torch.zeros_like(p) for p in params]
        for start in range(0, b, chunk):
            end = min(b, start + chunk)
            xc = x[start:end].clone().requires_grad_(train)
            lengths = setup.lengths[start:end]
            with torch.set_grad_enabled(train):
                if unit.cell == "layernorm_lstm":
                    y = cp.loop_over_time(model, xc, lengths)
                else:
                    y = model(xc)[0]
                if train:
                    for p in params:
                        p.grad = None
                    (y * g[start:end]).sum().backward()
                    grads_x.append(xc.grad)
                    for acc, p in zip(grads_w, params):
                        acc += p.grad
            outs.append(y.detach())
        self.out = torch.cat(outs) * setup.mask
        self.scale = max(1.0, float(self.out.abs().max()))
        self.mask = setup.mask
        self.grads = ([torch.cat(grads_x)] + grads_w) if train else None
        self.chunks = math.ceil(b / chunk)
        del model

    @staticmethod
    def chunk_size(unit, device):
        b, h, t = unit.shape.batch, unit.shape.hidden, unit.shape.steps
        if device != "cuda" or unit.mode == "infer":
            return b
        per_sequence = t * h * REFERENCE_BYTES[unit.cell]
        free, _ = torch.cuda.mem_get_info()
        return max(1, min(b, int(free / 3 // per_sequence)))

    def errors(self, out, grads):
        """{"output": .., "grads": ..} of a call's output and gradients against these."""
        diff = (out.double() - self.out) * self.mask
        result = {"output": float(diff.abs().max()) / self.scale}
        if grads is not None and self.grads is not None:
            result["grads"] = max(relative(g, r) for g, r in zip(grads, self.grads))
        return result


# ---- helpers ------------------------------------------------------------------------------------

@contextlib.contextmanager
def precision_context(precision, device):
    """The PyTorch switches and autocast of a row's precision (cellc.RNN follows them)."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if precision in HALF:
        with torch.autocast(device_type=device, dtype=HALF[precision]):
            yield
    else:
        yield


def loss(out, weights):
    """A weighted sum of the outputs (zero weights at padding), or the sum of a packed output."""
    if weights is not None and out.shape == weights.shape:
        return (out.float() * weights).sum()
    return out.float().sum()


def names(module):
    """A module's parameters by cellc's names (`weight_ih` for `weight_ih_l0` and for
    `layernorm_i.weight`'s `layernorm_i_weight`)."""
    return {re.sub(r"_l0$", "", n.replace(".", "_")): p for n, p in module.named_parameters()}


def ordered(module, rnn):
    """`module`'s parameters in the order of cellc.RNN `rnn`'s; those it lacks (the vendor's
    LSTM timed against another cell) in its own order."""
    mine, theirs = names(module), list(names(rnn))
    if set(theirs) <= set(mine):
        return [mine[n] for n in theirs]
    return list(module.parameters())


def load(module, rnn):
    """Copies cellc.RNN `rnn`'s weights into the PyTorch module of the same cell."""
    mine = names(module)
    with torch.no_grad():
        for name, p in names(rnn).items():
            mine[name].copy_(p)


def relative(got, want):
    want = want.double()
    norm = float(want.norm())
    return float((got.double() - want).norm()) / (norm if norm > 0 else 1.0)


def judge(row, ours, theirs, precision, f32_theirs=None):
    """The row's status: `measured`, `failed` (cellc did not run) or `wrong` (its error past the
    bound: its precision's floor, and four times PyTorch's error on the same inputs: in
    `precision` (`theirs`), or where none was measured there, in f32 (`f32_theirs`))."""
    if row["cellc_ms"] is None:
        row["status"] = "failed"
        return
    bounds = {}
    for i, what in enumerate(("output", "grads")):
        if ours is None or what not in ours:
            continue
        floor = FLOOR[precision][i]
        theirs_e = (theirs or {}).get(what)
        if theirs_e is None:
            theirs_e = (f32_theirs or {}).get(what)
        bounds[what] = max(floor, TIMES_PYTORCH_ERROR * theirs_e) if theirs_e is not None and \
            math.isfinite(theirs_e) else floor
    row["bounds"] = bounds
    bad = [w for w, b in bounds.items() if not ours[w] <= b]  # NaN is wrong too
    row["status"] = "wrong" if bad else "measured"


def torch_errors(row):
    """PyTorch's errors a recorded Python row holds (None where there are none, or no row)."""
    return ((row or {}).get("errors") or {}).get("torch")


def judge_again(carried, rows):
    """Judges the Python rows of `carried` (rows an earlier check measured) again by this
    check's rule, from the errors they recorded, with PyTorch's f32 errors of the same unit
    among `rows`."""
    by_key = {grid.key_of(r): r for r in rows}
    for row in carried:
        if row["source"] == "python" and row.get("cellc_ms") is not None:
            f32 = by_key.get(grid.key_of(dict(row, precision="f32")))
            judge(row, (row.get("errors") or {}).get("cellc"), torch_errors(row), row["precision"],
                  torch_errors(f32))


def add_ratios(row, cell):
    """ratio: PyTorch's faster route of the same cell / cellc; for the LayerNorm-LSTM the
    vendor's plain nn.LSTM (its faster route: `ratio`) and its TorchScript cell (`ratio_torchscript`)."""
    ms, c = row.get("torch_ms") or {}, row.get("cellc_ms")
    vendor = {k: v for k, v in ms.items() if k in ("padded", "packed")}
    row["torch_best"] = min(vendor, key=vendor.get) if vendor else None
    row["ratio"] = vendor[row["torch_best"]] / c if vendor and c else None
    if cell == "layernorm_lstm":
        row["ratio_torchscript"] = ms["torchscript"] / c if "torchscript" in ms and c else None


def base_row(source, cell, shape, mode, precision, tier):
    return dict(source=source, tier=tier, cell=cell, batch=shape.batch, hidden=shape.hidden, steps=shape.steps,
                mode=mode, precision=precision)


# Kernels by name: cuBLAS's and CUTLASS's products; copies and fills; the rest are pointwise
# (cellc's generated step kernels, cuDNN's element-wise and persistent RNN kernels).
PRODUCT = re.compile(r"gemm|gemv|xmma|cutlass|cublas|wgmma|splitKreduce|dot_kernel", re.I)
COPY = re.compile(r"memcpy|memset", re.I)


def kernel_breakdown(events, runs, steps, wall):
    """A profile's GPU activity per call and per step."""
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = lambda es: sum(e.self_device_time_total for e in es) / runs  # noqa: E731 (µs per call)
    kinds = {"product": [e for e in gpu if PRODUCT.search(e.key)], "copy": [e for e in gpu if COPY.search(e.key)]}
    kinds["pointwise"] = [e for e in gpu if e not in kinds["product"] and e not in kinds["copy"]]
    busy_us = total(gpu)
    ops = sum(e.count for e in gpu) / runs
    top = sorted(gpu, key=lambda e: -e.self_device_time_total)[:6]
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy_us / 1e3, "busy_fraction": busy_us / 1e3 / (wall * 1e3),
            "gpu_ops_per_call": ops, "gpu_ops_per_step": ops / steps,
            "us_per_step": {k: total(v) / steps for k, v in kinds.items()},
            "top": [[e.key[:90], e.self_device_time_total / runs] for e in top]}


def release():
    """Frees what a failed or finished route left on the GPU."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def short(e):
    return f"{type(e).__name__}: {last_line(str(e))}"


def last_line(text):
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
