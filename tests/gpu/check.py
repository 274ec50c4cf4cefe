#!/usr/bin/env python3
"""The GPU check: everything cellc's CUDA back end must show on a real GPU, in one command,
correctness first, then speed at the sizes people train, inside a time budget.

    python3 check.py --out DIR [--pack ARCHIVE_OR_FOLDER] [--budget SECONDS] [--resume]
    python3 check.py --out DIR --grid-from EARLIER_RESULTS.json   # every step; the grid goes on
    python3 check.py --out DIR --emulated --cuda-lib-dir NVRTC_FOLDER
    python3 check.py --plan [--emulated]       # the speed step's tasks and estimates; runs nothing

Run it with the Python that has PyTorch (on the GPU machine, plain `python3`).

The pack (made by tests/gpu/pack.sh on a machine with Rust) holds the `cellc` binary, the
GPU test binaries, the Python wheel, and the cells, fixtures and scripts they read. Steps:

  env        the GPU, driver, PyTorch, and where cellc finds CUDA's libraries (`cellc devices`)
  smoke      `cellc run` (2-layer bidirectional LSTM, forward and backward, both alignments,
             and with bf16, fp16 and TF32 products on the tensor cores) against PyTorch's values;
             `cellc bench` inference and training, with and without CUDA graphs, and in bf16,
             fp16 and TF32
  gpu-tests  tests/cuda_backend.rs and tests/device_memory.rs, one thread, failing if
             anything is skipped (CELLC_REQUIRE_GPU)
  pytest     runtime/python/tests/test_cuda.py (TF32 off for the reference), no skips
  sanitizer  compute-sanitizer memcheck and racecheck on tiny inference and training runs
  nvrtc      every shipped cell's kernels through NVRTC for the device's architecture
             (and sm_80, sm_90): no spills, at most 64 registers
  speed      the realistic grid (grid.py: H 256-1024, B 1-256, T 100 and 1000; LSTM and GRU
             against cuDNN's faster route, the LayerNorm-LSTM against cuDNN's plain LSTM and
             its TorchScript cell; inference and training; f32, TF32, bf16 and fp16), each row
             `cellc.RNN` on CUDA tensors (graphs on) with its output's and gradients' error
             against float64 (measure.py), `cellc bench` rows on host memory, and a
             torch.profiler row per shape class; in the order grid.py gives, so that a budget
             cut short still leaves one row of each kind

Logs go to DIR/logs/, results to DIR/results.json (rewritten after every step and every speed
row, so a run cut short keeps what it measured), and a short report is printed last and kept
in DIR/summary.md (its tables are report.py's, as the book's). With --resume, steps that passed
in DIR/results.json are not run again, and the speed step measures only the rows it lacks. Each
step gets at most its own cap and what is left of the budget; a step that would start with
under 10 s left is not run, and a speed task whose estimate exceeds what is left is left for
the next call. The whole grid takes several calls of 540 s, more than a lent GPU's session
allows: with --grid-from, every step runs again, and the speed step measures only the rows that
an earlier check's results (a committed benches/results/gpu_check_*.json) lack, carrying that
check's rows into this one's results, each marked with the commit and date it was measured at
(`measured`) and judged again by this check's rule. With --emulated the same control flow runs on a machine without a GPU: the
`cuda-emulated` back end, PyTorch on the CPU, tiny shapes, skips allowed.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grid  # noqa: E402 (beside this file, in the repository and in the pack)
import report  # noqa: E402

STEPS = ["env", "smoke", "gpu-tests", "pytest", "sanitizer", "nvrtc", "speed"]
# The most a step may take, in seconds (the budget may leave it less).
CAPS = {"env": 60, "smoke": 120, "gpu-tests": 240, "pytest": 300, "sanitizer": 180, "nvrtc": 120, "speed": 3600}
# Left of the budget when a speed task may start: its estimate and this margin.
SPEED_MARGIN = 10


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
        if args.grid_from:
            self.carry_grid(args.grid_from)
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

    def carry_grid(self, path):
        """The speed rows of an earlier check's results at `path` that this one lacks, each
        marked with the commit and date it was measured at (its own mark, where an earlier
        carry gave it one); they are judged again in the speed step."""
        with open(path) as f:
            earlier = json.load(f)
        mark = {"commit": earlier.get("manifest", {}).get("commit"), "date": earlier.get("device", {}).get("date"),
                "device": earlier.get("device", {}).get("name")}
        rows = self.results.setdefault("speed", [])
        have = {grid.key_of(r) for r in rows}
        carried = [dict(r, measured=r.get("measured", mark)) for r in earlier.get("speed", [])
                   if grid.key_of(r) not in have]
        rows.extend(carried)
        self.results["grid_from"] = dict(mark, rows=len(carried), file=os.path.basename(path))

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
        # float32 in both alignments; bf16, fp16 and TF32 products (cuBLAS's FAST_16BF,
        # FAST_16F, FAST_TF32) within their rounding.
        for align, dtype, bound in (("left", "f32", 1e-4), ("right", "f32", 1e-4), ("left", "bf16", 3e-2),
                                    ("left", "f16", 5e-3), ("left", "tf32", 5e-3)):
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
            for graphs, dtype in ((False, "f32"), (True, "f32"), (True, "bf16"), (True, "f16"), (True, "tf32")):
                cmd = [self.cellc, "bench", os.path.join(self.pack, "cells", "lstm.cell"), "-D", f"H={h}",
                       "--batch", b, "--steps", t, "--lengths", "uniform", "--mode", mode, "--min-time", "0.1",
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

    def step_speed(self):
        """The realistic grid, task by task in grid.py's order, each row saved as it is measured."""
        site, failed = self.wheel_site("speed")
        if failed:
            return "failed", failed
        sys.path[:0] = [site, os.path.join(self.pack, "benches")]
        os.environ.update(self.env)  # `cellc bench` runs as a child of this process
        import measure  # noqa: E402 (needs torch and the pack's cellc)

        m = measure.Measure("cpu" if self.emulated else "cuda", self.backend, self.args.min_time, self.cellc,
                            os.path.join(self.pack, "cells"), reference_chunk=2 if self.emulated else None)
        rows = self.results.setdefault("speed", [])
        measure.judge_again([r for r in rows if "measured" in r], rows)
        recorded = {grid.key_of(r): r for r in rows}
        tasks, compiled, new = grid.plan(self.emulated), set(), 0
        for task in tasks:
            estimate = grid.seconds(task, compiled)
            keys = grid.keys(task)
            if all(k in recorded for k in keys):
                continue
            # On the emulated device the estimates (an H100's) mean nothing: --max-rows cuts it.
            if not self.emulated and self.left() < estimate + SPEED_MARGIN:
                return "partial", f"{report.counts(self.results)}; the budget ran out before {grid.name(task)} " \
                                  f"(about {estimate:.0f} s): --resume goes on"
            measured = m.unit(task, recorded) if isinstance(task, grid.Unit) else iter([m.profile(task)])
            try:
                for row in measured:
                    rows.append(row)
                    recorded[grid.key_of(row)] = row
                    self.save()
                    new += 1
                    if self.args.max_rows and new >= self.args.max_rows:
                        return "partial", f"{report.counts(self.results)}; stopped after {new} new rows (--max-rows)"
                    if self.left() < SPEED_MARGIN:
                        return "partial", f"{report.counts(self.results)}; the budget ran out: --resume goes on"
            except Exception as e:  # the task could not be set up (memory, a module): its rows say why
                measure.release()
                for key in keys:
                    if key not in recorded:
                        row = dict(grid.row_of(key), tier=task.tier, status="failed", cellc_ms=None,
                                   cellc_error=f"{type(e).__name__}: {last_line(str(e))}")
                        rows.append(row)
                        recorded[key] = row
                self.save()
        bad = [r for r in rows if r["status"] in ("failed", "wrong")]
        if bad:
            r = bad[0]
            return "failed", f"{report.counts(self.results)}; first: {grid.key_of(r)}: {r['status']} " \
                             f"({r.get('cellc_error') or r.get('errors', {}).get('cellc')})"
        return "passed", report.counts(self.results)

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
        return "\n".join(lines + [""] + report.speed_report(self.results)) + "\n"


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
    ap.add_argument("--out", help="folder for logs, results.json and summary.md")
    ap.add_argument("--budget", type=float, default=540,
                    help="seconds for the whole check (default 540: one 10-minute call with room to unpack)")
    ap.add_argument("--resume", action="store_true",
                    help="skip the steps that passed in OUT/results.json, and the speed rows it holds")
    ap.add_argument("--grid-from", metavar="RESULTS_JSON",
                    help="an earlier check's results: its speed rows are carried, and the grid goes on from them")
    ap.add_argument("--steps", nargs="+", choices=STEPS, help="only these steps")
    ap.add_argument("--emulated", action="store_true", help="no GPU: the emulated device, PyTorch on the CPU")
    ap.add_argument("--cuda-lib-dir", action="append", default=[], help="a folder with CUDA's libraries (NVRTC)")
    ap.add_argument("--min-time", type=float, default=0.05, help="least measured seconds per timing")
    ap.add_argument("--plan", action="store_true", help="print the speed step's tasks and estimates, run nothing")
    ap.add_argument("--max-rows", type=int, default=0,
                    help="stop the speed step after this many new rows, as a budget running out would (testing --resume)")
    args = ap.parse_args()
    if args.plan:
        print(grid.describe(grid.plan(args.emulated)))
        return
    if not args.out:
        ap.error("--out is required")
    sys.exit(Check(args).main())


if __name__ == "__main__":
    main()
