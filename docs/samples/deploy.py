"""Deploying a model (docs/src/guides/deploy.md): a module with cellc.RNN, exported with
torch.export (the batch and the steps dynamic), compiled into an AOTInductor package with
PyTorch's defaults and run by PyTorch's loader in a process where the cellc package cannot be
imported (the generated code calls cellc's C shim, not Python); then the same module exported
with torch.onnx.export (dynamo, no extra arguments) and run by onnxruntime with cellc's
custom-operator library. Both equal eager."""
import os
import subprocess
import sys
import tempfile

import torch

import cellc


# ANCHOR: export
class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = cellc.RNN("layernorm_lstm", 16, {"H": 32}, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(64, 5)

    def forward(self, x, lengths):
        out, (h, c) = self.rnn(x, lengths=lengths, align="right")
        return self.head(out)


model = Tagger().eval()
x, lengths = torch.randn(4, 9, 16), torch.tensor([9, 3, 7, 5])
batch, steps = torch.export.Dim("batch", max=256), torch.export.Dim("steps", max=4096)
exported = torch.export.export(model, (x, lengths), dynamic_shapes={"x": {0: batch, 1: steps}, "lengths": {0: batch}})
folder = tempfile.mkdtemp()
package = torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(folder, "tagger.pt2"))
# ANCHOR_END: export

torch.save({"x": x, "lengths": lengths, "want": model(x, lengths)}, os.path.join(folder, "io.pt"))

# ANCHOR: run
RUN = """
import ctypes, os, sys
sys.modules["cellc"] = None          # no cellc package in this process
import torch
ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)   # cellc's C shim, before the package
tagger = torch._inductor.aoti_load_package(sys.argv[2])
io = torch.load(sys.argv[3])
torch.testing.assert_close(tagger(io["x"], io["lengths"]), io["want"], atol=1e-5, rtol=1e-5)
print("the package equals eager")
"""
done = subprocess.run([sys.executable, "-c", RUN, cellc.aoti_library(), package, os.path.join(folder, "io.pt")],
                      capture_output=True, text=True)
# ANCHOR_END: run
assert done.returncode == 0, done.stderr[-2000:]
print(done.stdout.strip())

path = os.path.join(tempfile.mkdtemp(), "tagger.onnx")

# ANCHOR: onnx
import onnxruntime as ort

batch, steps = torch.export.Dim("batch", max=256), torch.export.Dim("steps", max=4096)
torch.onnx.export(model, (x, lengths), dynamo=True,
                  dynamic_shapes={"x": {0: batch, 1: steps}, "lengths": {0: batch}}).save(path)

options = ort.SessionOptions()
options.register_custom_ops_library(cellc.onnx_library())
tagger = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
(scores,) = tagger.run(None, {"x": x.numpy(), "lengths": lengths.numpy()})
# ANCHOR_END: onnx

with torch.no_grad():
    torch.testing.assert_close(torch.from_numpy(scores), model(x, lengths), atol=1e-5, rtol=1e-5)
print("ONNX Runtime equals eager")
