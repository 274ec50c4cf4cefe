"""Exported models: ``torch.export`` of a module that uses ``cellc.RNN``, and the package
``torch._inductor.aoti_compile_and_package`` builds from it with its default arguments, whose
generated code calls cellc through its C shim (``aoti_torch_cpu_cellc_rnn``): in this process,
and in one where the ``cellc`` Python package cannot be imported. Equal to eager; what an
exported model cannot carry is an error at export time."""

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import cellc
from cellc import _ops
from conftest import needs_gxx

#: A cell of the test's own: a leaky tanh RNN with a gate of its own.
OWN_CELL = """
cell leaky {
    input  x[I]
    state  h[H]
    param  w[2*H, I], u[2*H, H], b[2*H]
    let a, z = chunk(w @ x + u @ h + b, 2)
    h' = sigmoid(z) * tanh(a) + (1 - sigmoid(z)) * h
    output h'
}
"""

CELLS = {
    "lstm": ("lstm", {"H": 12}, 2, True),
    "gru": ("gru", {"H": 12}, 2, True),
    "layernorm_lstm": ("layernorm_lstm", {"H": 12}, 2, True),
    # The sLSTM reads gate pre-activations: one layer, one way.
    "slstm": ("slstm", {"D": 4}, 1, False, 64),
    "own": (OWN_CELL, {"H": 12}, 2, True),
}


class Tagger(torch.nn.Module):
    """A module as a user writes one: the RNN between other layers."""

    def __init__(self, name, align, backend=None):
        super().__init__()
        cell, sizes, layers, bidirectional, input_size = (*CELLS[name], 8)[:5]
        self.rnn = cellc.RNN(cell, input_size, sizes, layers, bidirectional=bidirectional, batch_first=True,
                             backend=backend)
        self.head = torch.nn.Linear(self.rnn.hidden_size * (2 if bidirectional else 1), 3)
        self.align = align

    def forward(self, x, lengths):
        out, finals = self.rnn(x, lengths=lengths, align=self.align)
        finals = finals if isinstance(finals, tuple) else (finals,)
        return (self.head(out), *finals)


class BothAlignments(torch.nn.Module):
    """Two taggers of one cell, left- and right-aligned, in one module: one package holds both."""

    def __init__(self, name):
        super().__init__()
        self.left, self.right = Tagger(name, "left"), Tagger(name, "right")

    def forward(self, x, lengths):
        return (*self.left(x, lengths), *self.right(x, lengths))


def inputs(model, batch=3, steps=7):
    torch.manual_seed(1)
    rnn = model.left.rnn if isinstance(model, BothAlignments) else model.rnn
    x = torch.randn(batch, steps, rnn.input_size)
    return x, torch.tensor([steps, 2, 5][:batch])


def close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CELLS))
@pytest.mark.parametrize("align", ["left", "right"])
def test_exported_program_equals_eager(name, align):
    torch.manual_seed(0)
    model = Tagger(name, align).eval()
    x, lengths = inputs(model)
    ep = torch.export.export(model, (x, lengths))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "cellc.cellc_rnn.default" in ops, ops
    close(ep.module()(x, lengths), model(x, lengths))


def shim_library() -> str:
    """The library with the C shim: ``CELLC_AOTI_LIBRARY`` (CI names the ``cellc-aoti`` crate's
    ``libcellc_aoti.so``), else the package's extension, which exports it too."""
    return os.environ.get("CELLC_AOTI_LIBRARY") or cellc._cellc.__file__


#: Runs a package in a process that cannot import cellc: the shim's library loaded, then PyTorch's own loader.
WITHOUT_CELLC = textwrap.dedent("""
    import ctypes, os, sys
    sys.modules["cellc"] = None
    import torch
    try:
        import cellc
        raise SystemExit("cellc was importable")
    except ImportError:
        pass
    ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
    io = torch.load(sys.argv[3])
    got = torch._inductor.aoti_load_package(sys.argv[2])(*io["inputs"])
    for a, b in zip(got, io["want"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    print("equal", len(got))
""")


@pytest.mark.parametrize("name", sorted(CELLS))
def test_aoti_package_runs_without_the_python_package(name, tmp_path):
    """Both alignments through one package (two cellc::cellc_rnn calls)."""
    program = aoti_package_equals_eager(BothAlignments(name).eval(), tmp_path)
    layouts = [n.args[1] for n in program.graph.nodes if n.target == torch.ops.cellc.cellc_rnn.default]
    assert layouts == ["batch_first/left", "batch_first/right"], layouts


@needs_gxx
@pytest.mark.parametrize("tf32", [False, True], ids=["f32", "tf32"])
def test_aoti_package_on_the_emulated_device(tf32, tmp_path):
    """The device-memory route of the shim (a GPU's CUDA tensors, queued on PyTorch's stream),
    run over the emulated device, whose memory is the host's: the package equals eager mode,
    also where PyTorch lets cuDNN's RNN use TF32 and the products are TF32 in both."""
    torch.backends.cudnn.allow_tf32 = tf32
    model = Tagger("layernorm_lstm", "right", backend="cuda-emulated").eval()
    program = aoti_package_equals_eager(model, tmp_path)
    calls = [n for n in program.graph.nodes if n.target == torch.ops.cellc.cellc_rnn.default]
    assert [n.args[-1] for n in calls] == ["tf32" if tf32 else "f32"]


def aoti_package_equals_eager(model, tmp_path):
    """Exports `model` (batch and steps dynamic), compiles its AOTInductor package, and checks
    it against eager mode in this process and in one where cellc cannot be imported; returns
    the exported program."""
    torch.manual_seed(0)
    x, lengths = inputs(model)
    want = model(x, lengths)
    # The batch and the steps dynamic, as a deployed model takes them.
    batch, steps = torch.export.Dim("batch", max=64), torch.export.Dim("steps", max=1000)
    ep = torch.export.export(model, (x, lengths), dynamic_shapes={"x": {0: batch, 1: steps}, "lengths": {0: batch}})
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    close(torch._inductor.aoti_load_package(path)(x, lengths), want)
    # Another batch than the one exported with, through the same package.
    x2, lengths2 = inputs(model, batch=2, steps=9)
    close(torch._inductor.aoti_load_package(path)(x2, lengths2), model(x2, lengths2))
    io = tmp_path / "io.pt"
    torch.save({"inputs": (x, lengths), "want": want}, io)
    done = subprocess.run([sys.executable, "-c", WITHOUT_CELLC, shim_library(), path, str(io)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "equal" in done.stdout
    return ep


def test_a_spec_of_another_cellc_version_is_refused_by_the_shim():
    """The shim compiles the cell from the spec the package carries, and refuses one that
    another cellc version wrote, by name (run in a child: the message goes to its stderr)."""
    model = cellc.RNN("lstm", 4, 6)
    spec = model.spec.replace(f'"cellc": "{cellc.__version__}"', '"cellc": "0.0.1"')
    assert spec != model.spec
    child = textwrap.dedent("""
        import ctypes, os, sys
        import torch
        lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
        f = lib.aoti_torch_cpu_cellc_rnn
        out, fin = ctypes.c_void_p(), ctypes.c_void_p()
        code = f(sys.argv[2].encode(), b"batch_first/left", None, None, None, ctypes.c_int64(0), None,
                 ctypes.c_int64(0), b"f32", ctypes.byref(out), ctypes.byref(fin))
        print("code", code)
    """)
    done = subprocess.run([sys.executable, "-c", child, shim_library(), _ops.export_spec(spec)],
                          capture_output=True, text=True, timeout=120)
    assert "code 1" in done.stdout, (done.stdout, done.stderr)
    assert "cellc 0.0.1" in done.stderr and cellc.__version__ in done.stderr, done.stderr


def test_what_an_export_cannot_carry_is_named_at_export_time():
    x = torch.randn(2, 5, 4)
    lengths = torch.tensor([5, 3])

    class Call(torch.nn.Module):
        def __init__(self, rnn, **kwargs):
            super().__init__()
            self.rnn, self.kwargs = rnn, kwargs

        def forward(self, x, lengths):
            return self.rnn(x, lengths=lengths, **self.kwargs)[0]

    training = cellc.RNN("lstm", 4, 6, 2, dropout=0.3, batch_first=True).train()
    with pytest.raises(cellc.ExportError, match="model.eval"):
        torch.export.export(Call(training), (x, lengths))
    plain = cellc.RNN("lstm", 4, 6, batch_first=True).eval()
    resets = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(cellc.ExportError, match="resets"):
        torch.export.export(Call(plain, resets=resets), (x, lengths))

    class Autocast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = plain

        def forward(self, x, lengths):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.rnn(x, lengths=lengths)[0]

    with pytest.raises(cellc.ExportError, match="bf16"):
        torch.export.export(Autocast(), (x, lengths))

    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = plain

        def forward(self, x, lengths):
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return self.rnn(packed)[0].data

    with pytest.raises(cellc.ExportError, match="PackedSequence"):
        torch.export.export(Packed(), (x, lengths))

    # The kernels are compiled for the input's feature size: PyTorch's export refuses to make it
    # dynamic, naming the dimension, at export time.
    features = torch.export.Dim("features")
    with pytest.raises(torch._dynamo.exc.UserError, match="features"):
        torch.export.export(Call(plain), (x, lengths), dynamic_shapes={"x": {2: features}, "lengths": None})


@needs_gxx
def test_onnx_of_a_model_on_the_emulated_device(tmp_path):
    """A model made for the emulated device exports a node that ONNX Runtime runs there (its
    memory is the host's), equal to eager mode; TF32 products, which eager mode computes where
    PyTorch lets cuDNN use them, are an error at export time naming the switch."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = cellc.RNN("lstm", 4, 6, 2, batch_first=True, backend="cuda-emulated").eval()
    x = torch.randn(2, 5, 4)
    path = tmp_path / "emulated.onnx"
    torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(str(path))
    run = session(path)
    got = run.run(None, {run.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        out, (h, c) = model(x)
    close([torch.from_numpy(v) for v in got], [out, h, c])
    assert len(got) == 3
    torch.backends.cudnn.allow_tf32 = True
    # torch.onnx.export wraps the errors of its torch.export step, cause and message kept.
    with pytest.raises(Exception, match="allow_tf32 = False") as refused:
        torch.onnx.export(model, (x,), dynamo=True, verbose=False)
    assert isinstance(refused.value.__cause__, cellc.ExportError), refused.value


def test_the_c_shim_is_declared_to_aotinductor():
    from torch._inductor import config

    assert config.aot_inductor.custom_ops_to_c_shims[torch.ops.cellc.cellc_rnn.default] == _ops.C_SHIMS
    # The package's extension exports both, promoted to the process's global scope at import.
    assert ctypes.CDLL(None).aoti_torch_cpu_cellc_rnn is not None
    assert ctypes.CDLL(None).aoti_torch_cuda_cellc_rnn is not None


RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "aoti", "runner", "run_package.cpp")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the C++ runner")
@pytest.mark.skipif(not os.environ.get("CELLC_AOTI_LIBRARY"), reason="CELLC_AOTI_LIBRARY names no libcellc_aoti.so")
def test_aoti_package_runs_from_cpp_with_no_python(tmp_path):
    """The package, run by a C++ program linked against libtorch and libcellc_aoti.so
    (``runtime/aoti/runner``), built with the command its header gives: no Python interpreter in
    the process, and the outputs equal eager mode's."""
    from torch.utils import cpp_extension

    library = os.environ["CELLC_AOTI_LIBRARY"]
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    cellc_lib = os.path.dirname(os.path.abspath(library))
    exe = tmp_path / "run_package"
    build = ["g++", "-std=c++20", "-O1", os.path.abspath(RUNNER), "-o", str(exe),
             *[f"-I{p}" for p in cpp_extension.include_paths()], "-Wl,--no-as-needed",
             f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10",
             f"-L{cellc_lib}", f"-Wl,-rpath,{cellc_lib}", "-l:" + os.path.basename(library)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    needed = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout
    assert "libpython" not in needed and "libcellc_aoti" in needed, needed

    torch.manual_seed(0)
    model = Tagger("layernorm_lstm", "right").eval()
    x, lengths = inputs(model)
    package = torch._inductor.aoti_compile_and_package(torch.export.export(model, (x, lengths)),
                                                       package_path=str(tmp_path / "model.pt2"))
    torch.save([x, lengths], tmp_path / "inputs.pt")
    done = subprocess.run([str(exe), package, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # The runner's own file (torch::pickle_save), read back here.
    close(torch.load(tmp_path / "outputs.pt", weights_only=False), model(x, lengths))


# ---- ONNX: torch.onnx.export(dynamo=True) and ONNX Runtime -------------------------------

if os.environ.get("CELLC_REQUIRE_ONNX"):
    # CI installs them: there the ONNX tests run, never skip.
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401


def onnx_library() -> str:
    """``CELLC_ONNX_LIBRARY`` (CI names the ``cellc-onnx`` crate's ``libcellc_onnx.so``), else
    the package's extension, which exports the same entry point."""
    return os.environ.get("CELLC_ONNX_LIBRARY") or cellc.onnx_library()


def session(path):
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.register_custom_ops_library(onnx_library())
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class WithStates(torch.nn.Module):
    """The RNN with initial states given, each output returned."""

    def __init__(self, name, align):
        super().__init__()
        self.inner = Tagger(name, align)

    def forward(self, x, lengths, *h0):
        out, finals = self.inner.rnn(x, lengths=lengths, align=self.inner.align, hx=h0 if len(h0) > 1 else h0[0])
        finals = finals if isinstance(finals, tuple) else (finals,)
        return (out, *finals)


@pytest.mark.parametrize("name", sorted(CELLS))
@pytest.mark.parametrize("align", ["left", "right"])
def test_onnx_runtime_runs_the_exported_node_as_eager(name, align, tmp_path):
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    torch.manual_seed(0)
    model = WithStates(name, align).eval()
    x, lengths = inputs(model.inner)
    rnn = model.inner.rnn
    slots = rnn.num_layers * (2 if rnn.bidirectional else 1)
    h0 = [torch.randn(slots, x.shape[0], size) for size in rnn.state_sizes]
    batch, steps = torch.export.Dim("batch", max=64), torch.export.Dim("steps", max=1000)
    dynamic = {"x": {0: batch, 1: steps}, "lengths": {0: batch}, "h0": tuple({1: batch} for _ in h0)}
    program = torch.onnx.export(model, (x, lengths, *h0), dynamo=True, dynamic_shapes=dynamic, verbose=False)
    path = tmp_path / "model.onnx"
    program.save(str(path))
    graph = onnx.load(str(path)).graph
    nodes = [n for n in graph.node if n.domain == "cellc"]
    assert [n.op_type for n in nodes] == ["RNN"], [(n.domain, n.op_type) for n in graph.node]
    attributes = {a.name for a in nodes[0].attribute}
    assert {"spec", "layout", "cellc_version", "cell", "initial_states"} <= attributes, attributes
    # The weights are initialisers under PyTorch's names (the exporter's optimiser keeps one of
    # several equal ones: a LayerNorm's unit gains share one).
    names = {i.name for i in graph.initializer}
    weights = list(nodes[0].input)[2 + len(h0):]
    assert len(weights) == len(rnn._weight_names), weights
    assert all(w in names and w.startswith("inner.rnn.") for w in weights), (weights, names)
    run = session(path)
    for batch_size, steps_count in [(3, 7), (2, 9)]:
        x, lengths = inputs(model.inner, batch=batch_size, steps=steps_count)
        h0 = [torch.randn(slots, batch_size, size) for size in rnn.state_sizes]
        feed = {i.name: t.numpy() for i, t in zip(run.get_inputs(), (x, lengths, *h0))}
        got = [torch.from_numpy(v) for v in run.run(None, feed)]
        with torch.no_grad():
            close(got, model(x, lengths, *h0))


def test_onnx_without_lengths_or_states_and_another_version_refused(tmp_path):
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    torch.manual_seed(0)

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = cellc.RNN("gru", 8, 12, 2, bidirectional=True)

        def forward(self, x):
            return self.rnn(x)

    model = Plain().eval()
    x = torch.randn(6, 3, 8)  # time first, every sequence full
    path = tmp_path / "plain.onnx"
    torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(str(path))
    got = session(path).run(None, {session(path).get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        close([torch.from_numpy(v) for v in got], model(x))

    # The node's spec names the cellc that exported it: another version fails the session.
    exported = onnx.load(str(path))
    node = next(n for n in exported.graph.node if n.domain == "cellc")
    spec = next(a for a in node.attribute if a.name == "spec")
    spec.s = spec.s.replace(f'"cellc": "{cellc.__version__}"'.encode(), b'"cellc": "0.0.1"')
    other = tmp_path / "other.onnx"
    onnx.save(exported, str(other))
    with pytest.raises(Exception, match="cellc 0.0.1"):
        session(other)
