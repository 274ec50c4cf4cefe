"""The GPU check's speed rows: which cells, shapes, modes and precisions are measured, in what
order, and about how long each takes, so that a budget cut short still leaves one row of each
kind and `--resume` goes on where a call stopped. Standard library only: `check.py --plan` prints
the plan anywhere, and docs/gen_perf.py reads the names.

The rows are grouped in *units*: one cell at one shape (batch B, hidden size H, steps T) in one
mode, measured in each precision in turn, against one float64 reference computed once for the
unit. A unit also times `cellc bench` (the runtime on host memory) in some of its precisions.
*Profiles* are separate tasks: one cell, shape class, mode and precision under torch.profiler.

Order (the `tier` of each task):

1. **core**: every cell (LSTM, LayerNorm-LSTM, GRU) at a small and a large shape, inference and
   training, in every precision, with `cellc bench` in every precision, then a profile of each
   shape class in float32 and bf16. Its first four units are the LSTM and the LayerNorm-LSTM at
   both shapes in training, each in f32 first and bf16 next, so that a cut anywhere after them
   leaves f32 and bf16, small and large, LSTM and LayerNorm-LSTM.
2. **T=100**: every other B x H at T=100, every cell, mode and precision, `cellc bench` in f32 and
   bf16.
3. **T=1000**: long sequences at fewer shapes, every cell and mode, in f32 and bf16 (the
   precisions people train long sequences in), `cellc bench` in f32.
"""
from dataclasses import dataclass

CELLS = ("lstm", "layernorm_lstm", "gru")
MODES = ("infer", "train")
# float32 with TF32 off, then bf16 and fp16 under autocast, then TF32 on (both sides).
PRECISIONS = ("f32", "bf16", "f16", "tf32")
HIDDENS = (256, 512, 1024)
BATCHES = (1, 16, 64, 256)
STEPS = (100, 1000)


@dataclass(frozen=True)
class Shape:
    batch: int
    hidden: int
    steps: int

    def text(self):
        return f"B={self.batch} H={self.hidden} T={self.steps}"


@dataclass(frozen=True)
class Unit:
    """One cell, shape and mode, measured from Python in `precisions` and by `cellc bench` in
    `bench` (a subset of them)."""
    tier: str
    cell: str
    shape: Shape
    mode: str
    precisions: tuple
    bench: tuple

    def key(self, source, precision):
        return row_key(source, self.cell, self.shape, self.mode, precision)


@dataclass(frozen=True)
class Profile:
    """torch.profiler over cellc and PyTorch's route at one shape class."""
    tier: str
    label: str
    cell: str
    shape: Shape
    mode: str
    precision: str

    def key(self):
        return row_key("profile", self.cell, self.shape, self.mode, self.precision)


def row_key(source, cell, shape, mode, precision):
    """What identifies a measured row (`source`: python, bench or profile) across calls."""
    return f"{source}/{cell}/{shape.batch}/{shape.hidden}/{shape.steps}/{mode}/{precision}"


def key_of(row):
    """The key of a row as check.py records it."""
    shape = Shape(row["batch"], row["hidden"], row["steps"])
    return row_key(row["source"], row["cell"], shape, row["mode"], row["precision"])


def row_of(key):
    """The fields a key names (the inverse of `row_key`)."""
    source, cell, batch, hidden, steps, mode, precision = key.split("/")
    return dict(source=source, cell=cell, batch=int(batch), hidden=int(hidden), steps=int(steps), mode=mode,
                precision=precision)


def keys(task):
    """The rows a task records."""
    if isinstance(task, Profile):
        return [task.key()]
    return [task.key("python", p) for p in task.precisions] + [task.key("bench", p) for p in task.bench]


def name(task):
    kind = f"profile ({task.label})" if isinstance(task, Profile) else "unit"
    return f"{kind} {task.cell} {task.mode} {task.shape.text()}"


# The shape classes: latency-bound (one sequence), a mid-sized batch, and the throughput-bound
# end of the grid, each also over long sequences in the grid.
SHAPE_CLASSES = {"small": Shape(1, 256, 100), "mid": Shape(64, 512, 100), "large": Shape(256, 1024, 100)}
CORE_SHAPES = {"small": Shape(64, 256, 100), "large": Shape(256, 1024, 1000)}
LONG_SHAPES = (Shape(1, 256, 1000), Shape(16, 512, 1000), Shape(64, 1024, 1000), Shape(256, 512, 1000))

def plan(emulated=False):
    """Every task of the check's speed step, in the order they run."""
    if emulated:
        return emulated_plan()
    tasks = []
    small, large = CORE_SHAPES["small"], CORE_SHAPES["large"]
    for mode in ("train", "infer"):
        tasks += [Unit("core", cell, shape, mode, PRECISIONS, PRECISIONS) for shape in (small, large)
                  for cell in ("lstm", "layernorm_lstm")]
    tasks += [Unit("core", "gru", shape, mode, PRECISIONS, PRECISIONS) for shape in (small, large) for mode in MODES]
    for label, shape in SHAPE_CLASSES.items():
        for precision in ("f32", "bf16"):
            for cell in ("lstm", "layernorm_lstm"):
                tasks += [Profile("core", label, cell, shape, mode, precision) for mode in MODES]
    done = {(u.cell, u.shape, u.mode) for u in tasks if isinstance(u, Unit)}
    for h in HIDDENS:
        for b in BATCHES:
            shape = Shape(b, h, 100)
            tasks += [Unit("T=100", cell, shape, mode, PRECISIONS, ("f32", "bf16")) for cell in CELLS
                      for mode in MODES if (cell, shape, mode) not in done]
    for shape in LONG_SHAPES:
        tasks += [Unit("T=1000", cell, shape, mode, ("f32", "bf16"), ("f32",)) for cell in CELLS for mode in MODES]
    return tasks


def emulated_plan():
    """The dry run's tasks: every kind of row (each cell and mode in each precision, `cellc
    bench` in each precision, a profile of each shape class, each tier) at sizes the emulated
    device runs in seconds."""
    small, mid, large, long = Shape(3, 8, 6), Shape(3, 16, 6), Shape(4, 16, 6), Shape(2, 8, 12)
    bench = {("lstm", "infer"): PRECISIONS, ("lstm", "train"): ("f32",), ("layernorm_lstm", "train"): ("bf16",)}
    tasks = [Unit("core", cell, small, mode, PRECISIONS, bench.get((cell, mode), ())) for cell in CELLS
             for mode in MODES]
    tasks += [Profile("core", "small", "lstm", small, "infer", "f32"),
              Profile("core", "mid", "layernorm_lstm", mid, "train", "bf16"),
              Profile("core", "large", "lstm", large, "train", "f32")]
    tasks += [Unit("T=100", "gru", mid, "train", ("f32", "f16"), ("f32",)),
              Unit("T=1000", "layernorm_lstm", long, "train", ("f32", "bf16"), ("f32",))]
    return tasks


# ---- What a task costs ------------------------------------------------------------------------
# A rough model of an H100 (seconds), for deciding whether a task still fits the budget and for
# `--plan`, calibrated on the H100 checks of 2026-11-27 (B=1 and 64, H=256, T=100); each row
# records what it took, to correct it. A fused RNN's call: a launch-bound floor per step plus the
# products at an effective rate; a TorchScript cell pays Python's loop per step (20.9 ms and
# 117 ms for the LayerNorm-LSTM's inference and training at T=100 on that H100).

RATE = {"f32": 30e12, "tf32": 150e12, "bf16": 250e12, "f16": 250e12}  # FLOP/s reached
STEP_FLOOR = {"infer": 12e-6, "train": 35e-6}  # per step: the kernels' launches and latency
TORCHSCRIPT_STEP = {"infer": 210e-6, "train": 1200e-6}  # per step of a scripted cell's loop
EAGER_F64_STEP = {"infer": 300e-6, "train": 1800e-6}  # the float64 reference's eager loop
MIN_TIME = 0.05  # the least seconds a route is timed for
CALLS = 4  # a warm-up and three timed calls at least (two where a call is long)
BENCH_PROCESS = 0.8  # `cellc bench`: the process, NVRTC at a size seen, the host batch
COMPILE = 1.0  # cellc's kernels for a cell, size and precision not seen before (NVRTC)
UNIT_SETUP = 0.5  # modules, inputs


def gates(cell):
    return 3 if cell == "gru" else 4


def call_seconds(cell, shape, mode, precision):
    """One call of a fused RNN (cellc's or cuDNN's) at `shape`."""
    b, h, t = shape.batch, shape.hidden, shape.steps
    flops = 2 * b * gates(cell) * h * 2 * h * t * (3 if mode == "train" else 1)
    return t * STEP_FLOOR[mode] + flops / RATE[precision]


def timed(call):
    """Seconds spent timing a route whose call takes `call`."""
    return max(MIN_TIME, CALLS * call) + call


def torchscript(cell, shape, precision):
    """Whether a row times the TorchScript cell: the LayerNorm-LSTM's, in every precision, but
    at T=1000 (a training call of over a second there) in f32 and bf16 alone; its other rows are
    held against nn.LSTM alone."""
    return cell == "layernorm_lstm" and (shape.steps <= 100 or precision in ("f32", "bf16"))


def unit_seconds(unit, compiled=None):
    """A unit's estimate; `compiled`: the (cell, H, precision) whose kernels earlier tasks
    compiled (updated)."""
    compiled = set() if compiled is None else compiled
    s = UNIT_SETUP
    for precision in unit.precisions:
        if (unit.cell, unit.shape.hidden, precision) not in compiled:
            compiled.add((unit.cell, unit.shape.hidden, precision))
            s += COMPILE
        call = call_seconds(unit.cell, unit.shape, unit.mode, precision)
        s += 3 * timed(call)  # cellc, and nn's padded and packed routes
        if torchscript(unit.cell, unit.shape, precision):
            s += timed(unit.shape.steps * TORCHSCRIPT_STEP[unit.mode])
    # The float64 reference: one call (an eager loop for the LayerNorm-LSTM, in chunks of the
    # batch in training), its products at a quarter of f32's rate.
    s += call_seconds(unit.cell, unit.shape, unit.mode, "f32") * 4
    if unit.cell == "layernorm_lstm":
        chunks = 1 if unit.mode == "infer" else max(1, unit.shape.batch * unit.shape.hidden * unit.shape.steps // 2**24)
        s += unit.shape.steps * EAGER_F64_STEP[unit.mode] * chunks
    for precision in unit.bench:
        s += BENCH_PROCESS + timed(call_seconds(unit.cell, unit.shape, unit.mode, precision))
    return s


def profile_seconds(p):
    return 1.0 + 2 * 10 * call_seconds(p.cell, p.shape, p.mode, p.precision)


def seconds(task, compiled=None):
    return unit_seconds(task, compiled) if isinstance(task, Unit) else profile_seconds(task)


def describe(tasks):
    """The plan as text: each task, its estimate, and each tier's total."""
    lines, totals, compiled = [], {}, set()
    for task in tasks:
        s = seconds(task, compiled)
        totals[task.tier] = totals.get(task.tier, 0.0) + s
        if isinstance(task, Unit):
            what = f"{task.cell} {task.mode} {task.shape.text()} in {' '.join(task.precisions)}; " \
                   f"bench {' '.join(task.bench) or '-'}"
        else:
            what = f"profile {task.label}: {task.cell} {task.mode} {task.shape.text()} {task.precision}"
        lines.append(f"{task.tier:<7} {s:7.1f} s  {what}")
    lines.append("")
    lines += [f"{tier:<7} {s:7.1f} s in all" for tier, s in totals.items()]
    lines.append(f"{'whole':<7} {sum(totals.values()):7.1f} s")
    return "\n".join(lines)
