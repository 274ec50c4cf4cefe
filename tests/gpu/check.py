#!/usr/bin/env python3
"""The GPU check: everything cellc's CUDA back end must show on a real GPU, in one command,
correctness first, then speed, inside a time budget.

    python3 check.py --out DIR [--pack ARCHIVE_OR_FOLDER] [--budget SECONDS] [--resume]
    python3 check.py --out DIR --emulated --cuda-lib-dir NVRTC_FOLDER

Run it with the Python that has PyTorch (on the GPU machine, plain `python3`).

The pack (made by tests/gpu/pack.sh on a machine with Rust) holds the `cellc` binary, the
GPU test binaries, the Python wheel, and the cells, fixtures and scripts they read. Steps:

  env        the GPU, driver, PyTorch, and where cellc finds CUDA's libraries (`cellc devices`)
  smoke      `cellc run` (2-layer bidirectional LSTM, forward and backward, both alignments,
             and with bf16 and fp16 products on the tensor cores) against PyTorch's values; `cellc
             bench` inference and training, with and without CUDA graphs, and in bf16 and fp16
  gpu-tests  tests/cuda_backend.rs and tests/device_memory.rs, one thread, failing if
             anything is skipped (CELLC_REQUIRE_GPU)
  pytest     runtime/python/tests/test_cuda.py (TF32 off for the reference), no skips
  sanitizer  compute-sanitizer memcheck and racecheck on tiny inference and training runs
  nvrtc      every shipped cell's kernels through NVRTC for the device's architecture
             (and sm_80, sm_90): no spills, at most 64 registers
  compare    cellc against cuDNN's nn.LSTM / nn.GRU (padded and packed) and TorchScript
             custom cells: B 1 and 64, H 256, T 100, inference and training, with and
             without CUDA graphs (TF32 off on both sides: the same precision); `cellc bench`
             times host-memory passes: uploads and downloads included
  python     cellc.RNN on CUDA tensors (resident, on PyTorch's stream) against nn.LSTM /
             nn.GRU in the same process, padded with lengths vs both of PyTorch's routes
  profile    where a call's time goes (torch.profiler, CUPTI): GPU kernel time against wall
             time per call, and the kernels by total time, cellc's and cuDNN's LSTM at B=64

Logs go to DIR/logs/, results to DIR/results.json (rewritten after every step, so a run cut
short keeps what it measured), and a short table is printed last and kept in DIR/summary.md.
With --resume, steps that passed in DIR/results.json are not run again. Each step gets at
most its own cap and what is left of the budget; a step that would start with under 10 s
left is not run. With --emulated the same control flow runs on a machine without a GPU:
the `cuda-emulated` back end, PyTorch on the CPU, tiny shapes, skips allowed.
"""
import argparse
import datetime
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time

STEPS = ["env", "smoke", "gpu-tests", "pytest", "sanitizer", "nvrtc", "compare", "python", "profile"]
# The most a step may take, in seconds (the budget may leave it less).
CAPS = {"env": 60, "smoke": 120, "gpu-tests": 240, "pytest": 180, "sanitizer": 180, "nvrtc": 120, "compare": 300,
        "python": 300, "profile": 120}


class Check:
    def __init__(self, args):
        self.args = args
        self.emulated = args.emulated
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="cellc-check-")
        self.pack = self.unpack(args.pack)
        self.python = sys.executable
        self.cellc = os.path.join(self.pack, "bin", "cellc")
        self.backend = "cuda-emulated" if self.emulated else "cuda"
        self.deadline = time.monotonic() + args.budget
        self.results_path = os.path.join(self.out, "results.json")
        self.results = {"steps": {}}
        if args.resume and os.path.exists(self.results_path):
            with open(self.results_path) as f:
                self.results = json.load(f)
        manifest = json.load(open(os.path.join(self.pack, "manifest.json")))
        manifest.pop("built_from", None)  # a path of the build machine: not for the results
        self.results.update(emulated=self.emulated, budget_s=args.budget, manifest=manifest)
        self.arch = self.results.get("device", {}).get("arch")
        self.env = dict(os.environ, CELLC_TEST_ROOT=self.pack,
                        CELLC_VERIFICATION_LOG=os.path.join(self.logs, "verification.log"), PYTHONUNBUFFERED="1")
        lib_dirs = list(args.cuda_lib_dir) + ([] if self.emulated else self.torch_cuda_lib_dirs())
        if lib_dirs:
            self.env["CELLC_CUDA_LIB_DIR"] = os.pathsep.join(lib_dirs)

    def unpack(self, pack):
        if os.path.isdir(pack):
            return os.path.abspath(pack)
        into = os.path.join(self.work, "pack")
        with tarfile.open(pack) as t:
            t.extractall(into, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(into)
        return into

    def torch_cuda_lib_dirs(self):
        """The lib folders of PyTorch's NVIDIA wheels (CUDA 13's shared folder first)."""
        code = ("import glob, os, nvidia; d = [p for b in nvidia.__path__ for p in sorted(glob.glob(os.path.join(b, '*', 'lib')))];"
                "print(os.pathsep.join(sorted(d, key=lambda p: 'cu13' not in p)))")
        r = subprocess.run([self.python, "-c", code], capture_output=True, text=True)
        return [d for d in r.stdout.strip().split(os.pathsep) if d]

    def left(self):
        return self.deadline - time.monotonic()

    def save(self):
        tmp = self.results_path + ".partial"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1)
        os.replace(tmp, self.results_path)

    def run(self, name, cmd, timeout, env=None, cwd=None):
        """Runs `cmd`, its output appended to logs/<name>.log; (exit code, output). 124 on timeout."""
        timeout = max(1, min(timeout, self.left()))
        log = os.path.join(self.logs, f"{name}.log")
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or self.env, cwd=cwd)
            out, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
            out += f"\n[timed out after {timeout:.0f} s]"
            rc = 124
        except OSError as e:
            out, rc = f"[cannot run: {e}]", 127
        with open(log, "a") as f:
            f.write(out + f"\n[exit {rc}]\n")
        return rc, out

    # --- steps -------------------------------------------------------------------------

    def step_env(self):
        device = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        rc, out = self.run("env", ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                                   "--format=csv,noheader"], 30)
        if rc == 0 and out.strip():
            name, driver, cap, memory = [s.strip() for s in out.strip().splitlines()[0].split(",")]
            device.update(name=name, driver=driver, compute_capability=cap, memory=memory,
                          arch="sm_" + cap.replace(".", ""))
        elif not self.emulated:
            return "failed", f"nvidia-smi: {out.strip()[-200:]}"
        rc, out = self.run("env", [self.python, "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__, "
                                   "torch.version.cuda, torch.cuda.is_available())"], 60)
        device["python_torch_cuda"] = out.strip().splitlines()[-1] if out.strip() else ""
        rc_devices, devices = self.run("env", [self.cellc, "devices"], 60)
        # The machine's own folders are not kept: `<site-packages>` stands for the one holding torch.
        device["cellc_devices"] = [re.sub(r"\S*/site-packages", "<site-packages>", line)
                                   for line in devices.strip().splitlines()]
        self.results["device"] = device
        self.arch = device.get("arch")
        if not self.emulated and rc_devices != 0:
            return "failed", "cellc devices: " + " | ".join(device["cellc_devices"][-3:])
        return "passed", f"{device.get('name', 'no GPU')} driver {device.get('driver', '-')}"

    def step_smoke(self):
        fixtures = os.path.join(self.pack, "tests", "fixtures", "runtime")
        notes = []
        # float32 in both alignments; bf16 and fp16 products (cuBLAS's FAST_16BF, FAST_16F)
        # within their rounding.
        for align, dtype, bound in (("left", "f32", 1e-4), ("right", "f32", 1e-4), ("left", "bf16", 3e-2),
                                    ("left", "f16", 5e-3)):
            out = os.path.join(self.work, f"run-{align}-{dtype}.safetensors")
            rc, text = self.run("smoke", [self.cellc, "run", os.path.join(self.pack, "cells", "lstm.cell"),
                                          "--weights", os.path.join(fixtures, "lstm_weights.safetensors"),
                                          "--input", os.path.join(fixtures, f"lstm_{align}_input.safetensors"),
                                          "--out", out, "--layers", "2", "--bidirectional", "--grad",
                                          "--align", align, "--backend", self.backend, "--dtype", dtype], 60)
            if rc != 0:
                return "failed", f"cellc run ({align}, {dtype}): {last_line(text)}"
            worst = compare_safetensors(out, os.path.join(fixtures, f"lstm_{align}_expected.safetensors"))
            notes.append(f"run {align} {dtype}: max err {worst:.1e}")
            if worst > bound:
                return "failed", f"cellc run ({align}, {dtype}) differs from PyTorch by {worst:.2e}"
        h, b, t = ("16", "3", "10") if self.emulated else ("256", "64", "100")
        timings = {}
        for mode in ("infer", "train"):
            for graphs, dtype in ((False, "f32"), (True, "f32"), (True, "bf16"), (True, "f16")):
                cmd = [self.cellc, "bench", os.path.join(self.pack, "cells", "lstm.cell"), "-D", f"H={h}",
                       "--batch", b, "--steps", t, "--lengths", "uniform", "--mode", mode, "--min-time", "0.3",
                       "--json", "--backend", self.backend, "--dtype", dtype] + (["--cuda-graphs"] if graphs else [])
                label = f"{mode}{'+graphs' if graphs else ''}{'' if dtype == 'f32' else '+' + dtype}"
                rc, text = self.run("smoke", cmd, 60)
                if rc != 0:
                    return "failed", f"cellc bench {label}: {last_line(text)}"
                timings[label] = json.loads(text.strip().splitlines()[-1])["median_s"] * 1e3
        self.results["smoke_bench_ms"] = dict(timings, shape=f"lstm H={h} B={b} T={t}")
        notes.append(" ".join(f"{k} {v:.2f} ms" for k, v in timings.items()))
        return "passed", "; ".join(notes)

    def step_gpu_tests(self):
        env = dict(self.env)
        if not self.emulated:
            env["CELLC_REQUIRE_GPU"] = "1"
        notes = []
        for test in ("cuda_backend", "device_memory"):
            # --nocapture: a passing test's SKIPPED line is printed, not swallowed. On a GPU
            # only the GPU tests run (named `..._a_gpu_...`): the emulated ones ran in CI.
            only = [] if self.emulated else ["a_gpu"]
            rc, out = self.run("gpu-tests", [os.path.join(self.pack, "tests", test), "--test-threads=1",
                                             "--nocapture", *only], CAPS["gpu-tests"], env=env)
            summary = [line for line in out.splitlines() if line.startswith("test result")]
            if rc != 0:
                failed = [line for line in out.splitlines() if line.startswith("test ") and line.endswith("FAILED")]
                return "failed", f"{test}: {' '.join(failed) or last_line(out)}"
            if not self.emulated and "SKIPPED" in out:
                return "failed", f"{test}: a test skipped on a GPU"
            passed = summary[-1].split(";")[0].split(".")[-1].strip() if summary else "?"
            skipped = out.count("SKIPPED")
            notes.append(f"{test}: {passed}" + (f", {skipped} skipped" if skipped else ""))
        return "passed", "; ".join(notes)

    def wheel_site(self, step):
        """The folder the pack's wheel is installed into (once); (folder, error)."""
        site = os.path.join(self.work, "site")
        if os.path.isdir(os.path.join(site, "cellc")):
            return site, None
        wheels = glob.glob(os.path.join(self.pack, "wheel", "*.whl"))
        rc, out = self.run(step, [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                  "--no-compile", "--target", site, *wheels], 120)
        return site, (f"installing the wheel: {last_line(out)}" if rc != 0 else None)

    def step_pytest(self):
        site, failed = self.wheel_site("pytest")
        if failed:
            return "failed", failed
        env = dict(self.env, PYTHONPATH=site + os.pathsep + self.env.get("PYTHONPATH", ""))
        tests = os.path.join(self.pack, "runtime", "python", "tests", "test_cuda.py")
        rc, out = self.run("pytest", [self.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", tests],
                           CAPS["pytest"], env=env, cwd=self.work)
        summary = last_line(out)
        if rc != 0:
            return "failed", summary
        if not self.emulated and "skipped" in summary:
            return "failed", f"skips on a GPU: {summary}"
        return "passed", summary

    def step_sanitizer(self):
        tool = shutil.which("compute-sanitizer") or next(iter(sorted(glob.glob(
            "/usr/local/cuda*/bin/compute-sanitizer") + glob.glob("/opt/nvidia/*/compute-sanitizer"))), None)
        if tool is None:
            return ("skipped" if self.emulated else "failed"), "compute-sanitizer not found"
        notes = []
        # lstm: GEMMs and lane kernels; layernorm_lstm: block kernels meeting at barriers.
        for check, cell, mode in (("memcheck", "lstm", "train"), ("memcheck", "layernorm_lstm", "train"),
                                  ("racecheck", "layernorm_lstm", "train"), ("racecheck", "lstm", "infer")):
            cmd = [tool, "--tool", check, "--error-exitcode", "9", "--print-limit", "20", self.cellc, "bench",
                   os.path.join(self.pack, "cells", f"{cell}.cell"), "-D", "H=37", "--batch", "3", "--steps", "5",
                   "--lengths", "uniform", "--mode", mode, "--min-time", "0", "--backend", self.backend]
            rc, out = self.run("sanitizer", cmd, 90)
            if rc != 0:
                return "failed", f"{check} {cell} {mode}: exit {rc}: {last_line(out)}"
            notes.append(f"{check} {cell} {mode}: clean")
        return "passed", "; ".join(notes)

    def step_nvrtc(self):
        env = dict(self.env, CELLC_REQUIRE_NVRTC="1")
        if self.arch:
            env["CELLC_NVRTC_ARCHS"] = self.arch
        rc, out = self.run("nvrtc", [os.path.join(self.pack, "tests", "cuda_nvrtc"), "--test-threads=1",
                                     "--nocapture"], CAPS["nvrtc"], env=env)
        if rc != 0:
            return "failed", last_line(out)
        lines = [line for line in out.splitlines() if "kernel compilations" in line or line.startswith("NVRTC ")]
        return "passed", " ".join(lines)

    def step_compare(self):
        sys.path.insert(0, os.path.join(self.pack, "benches"))
        import compare_pytorch as cp  # noqa: E402 (needs torch: imported only for this step)
        import torch

        cp.ROOT, cp.CELLC = self.pack, self.cellc
        os.environ.update(self.env)  # `cellc bench` runs as a child of this process
        device = "cpu" if self.emulated else "cuda"
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        cells = ["lstm"] if self.emulated else ["lstm", "gru", "layernorm_lstm"]
        batches, h, t = ([1], 16, 10) if self.emulated else ([1, 64], 256, 100)
        rows = self.results.setdefault("compare", [])
        done = {(r["cell"], r["mode"], r["batch"], r["graphs"]) for r in rows}
        for cell in cells:
            variants = ["padded", "packed"] if cell in ("lstm", "gru") else ["torchscript"]
            for mode in ("infer", "train"):
                for b in batches:
                    torch_s = None
                    for graphs in (False, True):
                        if (cell, mode, b, graphs) in done:
                            continue
                        if self.left() < 15:
                            return "partial", f"{len(rows)} rows measured before the budget ran out"
                        try:
                            c = cp.cellc_time(cell, b, t, h, None, mode, self.args.min_time, backend=self.backend,
                                              extra=["--cuda-graphs"] if graphs else [])["median_s"]
                            why = None
                        except subprocess.CalledProcessError as e:
                            c, why = None, last_line(e.stderr or "")
                        if torch_s is None:
                            torch_s = {v: cp.torch_time(cell, b, t, h, mode, v, self.args.min_time, device=device)
                                       for v in variants}
                        best = min(torch_s, key=torch_s.get)
                        rows.append(dict(cell=cell, mode=mode, batch=b, hidden=h, steps=t, graphs=graphs,
                                         cellc_ms=c and c * 1e3, cellc_error=why,
                                         torch_ms={v: s * 1e3 for v, s in torch_s.items()}, torch_best=best,
                                         ratio=(torch_s[best] / c) if c else None))
                        self.save()
        failed = [r for r in rows if r["cellc_ms"] is None]
        if failed:
            return "failed", f"cellc bench failed on {len(failed)} of {len(rows)} rows: {failed[0]['cellc_error']}"
        return "passed", f"{len(rows)} rows (ratio = PyTorch's faster route / cellc)"

    def in_process(self, step):
        """PyTorch and the pack's cellc package in this process (the wheel installed once):
        (torch, python_vs_nn, device, error). On a GPU, TF32 is off: the same precision as cellc."""
        site, failed = self.wheel_site(step)
        if failed:
            return None, None, None, failed
        sys.path[:0] = [site, os.path.join(self.pack, "benches")]
        os.environ.update(self.env)
        import torch
        import python_vs_nn  # noqa: E402 (needs torch and cellc)

        device = "cpu" if self.emulated else "cuda"
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        return torch, python_vs_nn, device, None

    def step_python(self):
        """cellc.RNN on tensors resident on the GPU (the caller's stream, no copies) against
        nn.LSTM / nn.GRU in the same process: what a PyTorch user gets."""
        torch, pv, device, failed = self.in_process("python")
        if failed:
            return "failed", failed
        batches, h, t = ([1], 16, 10) if self.emulated else ([1, 64], 256, 100)
        rows = self.results.setdefault("python", [])
        done = {(r["cell"], r["mode"], r["batch"]) for r in rows}
        for cell in ("lstm", "gru"):
            for mode in ("infer", "train"):
                for b in batches:
                    if (cell, mode, b) in done:
                        continue
                    if self.left() < 15:
                        return "partial", f"{len(rows)} rows measured before the budget ran out"
                    lengths = pv.lengths_uniform(b, t)
                    s = pv.times(cell, b, t, h, mode, lengths, self.args.min_time, device=device)
                    routes = {k: v for k, v in s.items() if k != "cellc"}
                    best = min(routes, key=routes.get)
                    rows.append(dict(cell=cell, mode=mode, batch=b, hidden=h, steps=t, device=device,
                                     cellc_ms=s["cellc"] * 1e3, torch_ms={k: v * 1e3 for k, v in routes.items()},
                                     torch_best=best, ratio=routes[best] / s["cellc"]))
                    self.save()
        return "passed", f"{len(rows)} rows (cellc.RNN on {device} tensors; ratio = PyTorch's faster route / cellc)"

    def step_profile(self):
        torch, pv, device, failed = self.in_process("profile")
        if failed:
            return "failed", failed
        from torch.profiler import ProfilerActivity, profile

        b, h, t = (4, 16, 10) if self.emulated else (64, 256, 100)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        lengths = torch.tensor(pv.lengths_uniform(b, t))
        notes, tables = [], []
        for cell in ("lstm",):
            mod, rnn = pv.pair(cell, b, t, h, lengths.tolist(), device)
            for mode in ("infer", "train"):
                x = torch.randn(b, t, h, device=device, requires_grad=(mode == "train"))
                calls = {"cellc": lambda: rnn(x, lengths=lengths)[0], "torch": lambda: mod(x)[0]}
                for who, fn in calls.items():
                    for _ in range(3):
                        pv.step(fn, mode, x)
                    sync()
                    runs = 5
                    with profile(activities=activities) as prof:
                        started = time.perf_counter()
                        for _ in range(runs):
                            pv.step(fn, mode, x)
                        sync()
                        wall = (time.perf_counter() - started) / runs
                    events = prof.key_averages()
                    gpu_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / runs
                    launches = sum(e.count for e in events if getattr(e, "self_device_time_total", 0)) / runs
                    notes.append(f"{who} {mode}: wall {wall * 1e3:.2f} ms, GPU busy {gpu_us / 1e3:.2f} ms, "
                                 f"{launches:.0f} GPU ops/call")
                    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
                    tables.append(f"### {who} {mode} (B={b} H={h} T={t}, {runs} calls)\n"
                                  + events.table(sort_by=sort, row_limit=12, max_name_column_width=60))
        with open(os.path.join(self.out, "profile.md"), "w") as f:
            f.write("\n\n".join(tables))
        self.results["profile"] = notes
        return "passed", "; ".join(notes)

    # --- driver ------------------------------------------------------------------------

    def main(self):
        wanted = self.args.steps or STEPS
        for name in STEPS:
            if name not in wanted:
                continue
            previous = self.results["steps"].get(name, {})
            if self.args.resume and previous.get("status") == "passed":
                print(f"[{name}] passed before, not run again", flush=True)
                continue
            if self.left() < 10:
                self.results["steps"][name] = dict(status="not run", seconds=0, note="the budget ran out")
                continue
            print(f"[{name}] ...", flush=True)
            started = time.monotonic()
            try:
                status, note = getattr(self, "step_" + name.replace("-", "_"))()
            except Exception as e:  # a broken step is reported and the next one runs
                status, note = "failed", f"{type(e).__name__}: {e}"
            seconds = time.monotonic() - started
            self.results["steps"][name] = dict(status=status, seconds=round(seconds, 1), note=note)
            self.save()
            print(f"[{name}] {status} in {seconds:.0f} s: {note}", flush=True)
        summary = self.summary()
        with open(os.path.join(self.out, "summary.md"), "w") as f:
            f.write(summary)
        print(summary)
        shutil.rmtree(self.work, ignore_errors=True)
        ok = all(s["status"] in ("passed", "skipped") for n, s in self.results["steps"].items() if n in wanted)
        return 0 if ok else 1

    def summary(self):
        d = self.results.get("device", {})
        lines = [f"## GPU check: {d.get('name', 'emulated device' if self.emulated else 'no GPU')}, "
                 f"driver {d.get('driver', '-')}, {d.get('date', '')}", "",
                 "| step | status | s | note |", "|---|---|---|---|"]
        for name in STEPS:
            s = self.results["steps"].get(name)
            if s:
                lines.append(f"| {name} | {s['status']} | {s['seconds']} | {s['note']} |")
        rows = self.results.get("python", [])
        if rows:
            lines += ["", "cellc.RNN on resident tensors, from Python:", "",
                      "| cell | mode | B | cellc ms | PyTorch ms (route) | ratio |", "|---|---|---|---|---|---|"]
            for r in rows:
                routes = ", ".join(f"{v} {ms:.3f}" for v, ms in r["torch_ms"].items())
                lines.append(f"| {r['cell']} | {r['mode']} | {r['batch']} | {r['cellc_ms']:.3f} | {routes} | "
                             f"{r['ratio']:.2f} |")
        rows = self.results.get("compare", [])
        if rows:
            lines += ["", "| cell | mode | B | graphs | cellc ms | PyTorch ms (route) | ratio |", "|---|---|---|---|---|---|---|"]
            for r in rows:
                routes = ", ".join(f"{v} {ms:.3f}" for v, ms in r["torch_ms"].items())
                cellc = f"{r['cellc_ms']:.3f}" if r["cellc_ms"] else f"failed: {r['cellc_error']}"
                ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
                lines.append(f"| {r['cell']} | {r['mode']} | {r['batch']} | {'yes' if r['graphs'] else 'no'} | "
                             f"{cellc} | {routes} | {ratio} |")
        return "\n".join(lines) + "\n"


def last_line(text):
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def read_safetensors(path):
    """{name: list of floats} of a safetensors file's F32 tensors (no numpy needed)."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__" or meta["dtype"] != "F32":
            continue
        start, end = meta["data_offsets"]
        raw = blob[8 + n + start:8 + n + end]
        out[name] = struct.unpack(f"<{len(raw) // 4}f", raw)
    return out


def compare_safetensors(got_path, want_path):
    """The largest |got - want| / max(1, |want|) over every tensor of `want`."""
    got, want = read_safetensors(got_path), read_safetensors(want_path)
    worst = 0.0
    for name, w in want.items():
        if name not in got or len(got[name]) != len(w):
            raise ValueError(f"{got_path} has no tensor `{name}` of {len(w)} values")
        worst = max([worst] + [abs(a - b) / max(1.0, abs(b)) for a, b in zip(got[name], w)])
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    default_pack = here if os.path.exists(os.path.join(here, "manifest.json")) else os.path.join(
        here, "..", "..", "target", "gpu-pack", "cellc-gpu.tar.gz")
    ap.add_argument("--pack", default=default_pack, help="the archive from pack.sh, or its unpacked folder")
    ap.add_argument("--out", required=True, help="folder for logs, results.json and summary.md")
    ap.add_argument("--budget", type=float, default=360, help="seconds for the whole check (default 360)")
    ap.add_argument("--resume", action="store_true", help="skip the steps that passed in OUT/results.json")
    ap.add_argument("--steps", nargs="+", choices=STEPS, help="only these steps")
    ap.add_argument("--emulated", action="store_true", help="no GPU: the emulated device, PyTorch on the CPU")
    ap.add_argument("--cuda-lib-dir", action="append", default=[], help="a folder with CUDA's libraries (NVRTC)")
    ap.add_argument("--min-time", type=float, default=0.2, help="least measured seconds per timing")
    args = ap.parse_args()
    sys.exit(Check(args).main())


if __name__ == "__main__":
    main()
