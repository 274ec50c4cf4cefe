"""Careless and hostile arguments a user may pass: each is one clear error naming the argument
and what it should be (never PyTorch's internals, never a misleading dtype), or it works where
it means something (an empty batch, a path whose name holds `{`)."""

import os

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import cellc
from cellc.errors import ShapeError


def test_empty_resets_name_their_shape_not_a_dtype():
    rnn = cellc.RNN("lstm", 3, 4, batch_first=True)
    with pytest.raises(ShapeError, match=r"`resets` has shape \[0\], expected \[2, 5\]: \[B, T\]"):
        rnn(torch.randn(2, 5, 3), resets=[])


def test_resets_of_an_unbatched_input_are_one_per_step():
    rnn = cellc.RNN("lstm", 3, 4, batch_first=True)
    x = torch.randn(5, 3)
    with pytest.raises(ShapeError, match=r"expected \[5\]: \[T\] \(a step of the unbatched input\)"):
        rnn(x, resets=torch.zeros(1, 5, dtype=torch.bool))
    flags = torch.zeros(5, dtype=torch.bool)
    flags[2] = True
    out, _ = rnn(x, resets=flags)
    assert out.shape == (5, 4)


def test_an_empty_batch_with_empty_lengths_runs():
    rnn = cellc.RNN("lstm", 3, 4, batch_first=True)
    out, (h, c) = rnn(torch.randn(0, 5, 3), lengths=[])
    assert out.shape == (0, 5, 4) and h.shape == (1, 0, 4)


@pytest.mark.parametrize("lengths", ["abc", [None, 3], [[1, 2], [3]], {"a": 1}])
def test_lengths_that_are_no_integers_are_a_type_error_naming_them(lengths):
    rnn = cellc.RNN("lstm", 3, 4, batch_first=True)
    with pytest.raises((TypeError, ShapeError), match="`lengths`"):
        rnn(torch.randn(2, 5, 3), lengths=lengths)


def test_resets_packed_otherwise_than_the_input_are_refused():
    rnn = cellc.RNN("lstm", 3, 4, batch_first=True)
    x = torch.randn(3, 7, 3)
    lengths = torch.tensor([4, 7, 2])
    resets = torch.zeros(3, 7, dtype=torch.bool)
    resets[1, 3] = True
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    same = pack_padded_sequence(resets, lengths, batch_first=True, enforce_sorted=False)
    rnn(packed, resets=same)  # packed alike: fine
    # The same rows, packed from other lengths or in another order: the flags would land elsewhere.
    for other_lengths in ([7, 4, 2], [5, 6, 2]):
        other = pack_padded_sequence(resets, torch.tensor(other_lengths), batch_first=True, enforce_sorted=False)
        assert other.data.shape == same.data.shape
        with pytest.raises(ShapeError, match="`resets` is a PackedSequence packed otherwise than `input`"):
            rnn(packed, resets=other)
    sorted_x = pack_padded_sequence(x[[1, 0, 2]], torch.tensor([7, 4, 2]), batch_first=True)
    with pytest.raises(ShapeError, match="`resets`"):
        rnn(sorted_x, resets=other)


@pytest.mark.parametrize("masks,error", [
    (None, TypeError), ([5, 9], TypeError), (torch.tensor([0.5, 1.0]), TypeError), (torch.tensor([1, 2, 3]), ValueError),
    (torch.tensor([-1, 2]), ValueError), (torch.tensor([2**62, 0]), ValueError),
])
def test_bad_masks_arguments_name_masks_and_what_they_should_be(masks, error):
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4}, num_layers=2, dropout=0.2, batch_first=True)
    x = torch.randn(2, 5, 3)
    with pytest.raises(error, match=r"`masks`.*int64 tensor of two values in \[0, 2\*\*62\)"):
        rnn.dropout_masks(x, masks)
    if masks is not None:
        with pytest.raises(error, match=r"`masks`.*int64 tensor of two values"):
            rnn.cell_masks(x, masks)
    packed = pack_padded_sequence(x, torch.tensor([5, 3]), batch_first=True)
    with pytest.raises(TypeError, match="`masks`"):
        rnn.cell_masks(x, packed)
    assert rnn.cell_masks(x, None)  # evaluation: no seed


def test_a_cell_path_whose_name_holds_a_brace_is_a_path(tmp_path):
    folder = tmp_path / "exp_{H}"
    folder.mkdir()
    path = folder / "my.cell"
    path.write_text(cellc.rnn.cell_source("lstm")[0])
    rnn = cellc.RNN(str(path), 3, 4)
    assert rnn.cell == "lstm"
    with pytest.raises(FileNotFoundError, match="no cell"):
        cellc.RNN(str(folder / "missing.cell"), 3, 4)
    with pytest.raises(FileNotFoundError, match="no cell"):
        cellc.RNN("{missing}.cell", 3, 4)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_an_endless_file_as_a_cell_is_an_error_at_once():
    with pytest.raises(ValueError, match="more than"):
        cellc.RNN("/dev/zero", 3, 4)
