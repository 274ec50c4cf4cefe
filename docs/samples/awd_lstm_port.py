"""Porting AWD-LSTM (Merity et al. 2018; salesforce/awd-lstm-lm) to cellc
(docs/src/guides/training.md): each `WeightDrop(nn.LSTM(...))` layer becomes one `awd_lstm` cell
with its own sizes and rates, the recipe's LockedDropout before a layer becomes the cell's
`dropout_input` (the same mask at every step of a sequence), and the recipe's checkpoints load
after renaming (`rnns.<l>.module.` prefixes, `weight_hh_l0_raw`)."""
import torch
from torch import nn

import cellc

torch.manual_seed(0)
NTOKEN, NINP, NHID, NLAYERS = 50, 12, 16, 3


# ANCHOR: recipe
class LockedDropout(nn.Module):
    """The recipe's: one mask per sequence and feature, the same at every step."""

    def forward(self, x, dropout=0.5):  # x: [T, B, F]
        if not self.training or not dropout:
            return x
        mask = x.new_empty(1, x.size(1), x.size(2)).bernoulli_(1 - dropout) / (1 - dropout)
        return mask * x


def layer_sizes(l):
    """Each layer's input and hidden sizes, as the recipe builds them (the last one ends at NINP)."""
    return (NINP if l == 0 else NHID), (NHID if l != NLAYERS - 1 else NINP)
# ANCHOR_END: recipe


class Recipe(nn.Module):
    """The recipe's recurrent stack (its RNNModel without the embedding's and decoder's parts):
    LockedDropout on each layer's input, plain nn.LSTM layers (WeightDrop drops nothing in
    evaluation, and nothing at weight_drop 0)."""

    def __init__(self, dropouti, dropouth):
        super().__init__()
        self.rnns = nn.ModuleList(nn.LSTM(*layer_sizes(l)) for l in range(NLAYERS))
        self.lockdrop, self.dropouti, self.dropouth = LockedDropout(), dropouti, dropouth

    def forward(self, emb):
        raw_output = self.lockdrop(emb, self.dropouti)
        for l, rnn in enumerate(self.rnns):
            raw_output, _ = rnn(raw_output)
            if l != NLAYERS - 1:
                raw_output = self.lockdrop(raw_output, self.dropouth)
        return raw_output


# ANCHOR: port
class Port(nn.Module):
    """The same stack on cellc: one awd_lstm cell per layer, with the layer's sizes, the recipe's
    weight drop, and its input's locked dropout as the cell's own dropout_input."""

    def __init__(self, dropouti, dropouth, wdrop):
        super().__init__()
        self.rnns = nn.ModuleList(
            cellc.RNN("awd_lstm", *layer_sizes(l),
                      rates={"weight_drop": wdrop, "dropout_input": dropouti if l == 0 else dropouth})
            for l in range(NLAYERS)
        )

    def forward(self, emb):  # [T, B, NINP], as the recipe's
        raw_output = emb
        for rnn in self.rnns:
            raw_output, _ = rnn(raw_output)
        return raw_output
# ANCHOR_END: port


# ANCHOR: checkpoint
def from_recipe(state_dict):
    """A recipe checkpoint's recurrent weights under the port's names: WeightDrop keeps each LSTM
    under `module.` and its recurrent weight as `weight_hh_l0_raw`; DataParallel adds `module.`
    in front of everything."""
    out = {}
    for name, value in state_dict.items():
        name = name.removeprefix("module.")
        if name.startswith("rnns."):
            out[name.replace(".module.", ".").replace("weight_hh_l0_raw", "weight_hh_l0")] = value
    return out
# ANCHOR_END: checkpoint


emb = torch.randn(9, 4, NINP)  # [T, B, NINP]
recipe, port = Recipe(dropouti=0.0, dropouth=0.0), Port(dropouti=0.0, dropouth=0.0, wdrop=0.0)
# A checkpoint saved by the recipe with WeightDrop (and DataParallel) names its weights so:
checkpoint = {f"module.rnns.{l}.module.{name.replace('weight_hh_l0', 'weight_hh_l0_raw')}": value
              for l, rnn in enumerate(recipe.rnns) for name, value in rnn.state_dict().items()}
checkpoint["module.encoder.weight"] = torch.randn(NTOKEN, NINP)
missing, unexpected = port.load_state_dict(from_recipe(checkpoint), strict=True)
assert not missing and not unexpected

# Every dropout at 0: the port is the recipe, in training and in evaluation.
for mode in ("train", "eval"):
    recipe.train(mode == "train"), port.train(mode == "train")
    torch.testing.assert_close(port(emb), recipe(emb), atol=2e-6, rtol=1e-5)

# ANCHOR: locked
# The cell's dropout_input is the recipe's LockedDropout: one mask per sequence and feature, the
# same at every step (cellc.RNN.cell_masks shows the mask a training call draws).
layer = cellc.RNN("awd_lstm", NINP, NHID, rates={"weight_drop": 0.5, "dropout_input": 0.65})
masks = layer.cell_masks(emb, cellc.draw_masks())
mask = masks["variational_dropout#0_l0"]                      # [T, B, NINP], as the input
assert torch.equal(mask, mask[:1].expand_as(mask))           # constant over the steps
kept = mask[0] != 0
assert torch.allclose(mask[0][kept], torch.tensor(1 / (1 - 0.65)))
assert 0.5 < 1 - kept.float().mean() < 0.8                   # about 0.65 of the units dropped
# ANCHOR_END: locked
print("ok")
