"""Deploying a model with ONNX Runtime (docs/src/guides/deploy.md): a module with cellc.RNN,
exported with torch.onnx.export (dynamo, no extra arguments), run by onnxruntime with cellc's
custom-operator library, equal to eager."""
import os
import tempfile

import torch

import cellc


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
