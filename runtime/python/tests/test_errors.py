"""Bad input raises a cellc exception naming the tensor and the shapes; never a crash."""

import pytest
import torch

import cellc


@pytest.fixture
def rnn():
    return cellc.RNN("lstm", 4, {"H": 6}, num_layers=2, batch_first=True)


def test_wrong_dtype(rnn):
    with pytest.raises(cellc.DTypeError, match="`input` is torch.float64"):
        rnn(torch.randn(2, 3, 4, dtype=torch.float64))
    with pytest.raises(TypeError):
        rnn(torch.randn(2, 3, 4, dtype=torch.float64))


def test_wrong_input_size(rnn):
    with pytest.raises(cellc.ShapeError, match=r"\[2, 3, 5\].*input_size=4"):
        rnn(torch.randn(2, 3, 5))


@pytest.mark.parametrize(
    "lengths, match",
    [([3, 4], "sequence 1 has length 4, longer than the 3 padded steps"), ([0, 2], "sequence 0 has length 0"), ([-1, 2], "negative length")],
)
def test_bad_lengths(rnn, lengths, match):
    with pytest.raises(cellc.LengthError, match=match):
        rnn(torch.randn(2, 3, 4), lengths=lengths)


def test_lengths_of_the_wrong_shape(rnn):
    with pytest.raises(cellc.ShapeError, match="lengths"):
        rnn(torch.randn(2, 3, 4), lengths=[3, 3, 3])


def test_bad_initial_state(rnn):
    h = torch.zeros(2, 2, 6)
    with pytest.raises(cellc.ShapeError, match="a tuple of 2 tensors"):
        rnn(torch.randn(2, 3, 4), h)
    with pytest.raises(cellc.ShapeError, match=r"initial state `c` has shape \[2, 2, 5\]"):
        rnn(torch.randn(2, 3, 4), (h, torch.zeros(2, 2, 5)))


def test_float64_module_and_input_must_agree(rnn):
    with pytest.raises(cellc.DTypeError, match="`input` is torch.float32.*float64 module"):
        rnn.double()(torch.randn(2, 3, 4))
    with pytest.raises(cellc.DTypeError, match="int32"):
        cellc.RNN("gru", 4, {"H": 3}, dtype=torch.int32)


def test_compile_errors_have_source_spans():
    with pytest.raises(cellc.CellCompileError, match=r"<source>:\d+:\d+"):
        cellc.RNN("cell bad { input x[I] state h[H] h' = tanh(q) output h' }", 3, {"H": 2})


def test_unknown_cell():
    with pytest.raises(FileNotFoundError, match="no cell `nope`"):
        cellc.RNN("nope", 3)


def test_unbound_size():
    with pytest.raises(cellc.ShapeError, match="size `H`"):
        cellc.RNN("lstm", 3)


def test_gil_is_released_during_a_call():
    import threading

    rnn = cellc.RNN("lstm", 64, {"H": 256}, batch_first=True)
    x = torch.randn(8, 400, 64)
    ticks = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(1)

    with torch.no_grad():
        rnn(x)  # compile the kernels first
        t = threading.Thread(target=tick)
        t.start()
        before = len(ticks)
        rnn(x)
        during = len(ticks) - before
        done.set()
        t.join()
    assert during > 100, f"the other thread ran only {during} times during the call"


def test_tensors_on_another_device(rnn):
    with pytest.raises(cellc.DeviceError, match="`input` is on meta"):
        rnn(torch.randn(2, 3, 4, device="meta"))
    with pytest.raises(cellc.DeviceError, match="initial state `h` is on meta"):
        rnn(torch.randn(2, 3, 4), (torch.zeros(2, 2, 6, device="meta"), torch.zeros(2, 2, 6)))
