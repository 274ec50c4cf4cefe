"""The rates of a cell's masks and the dropout between layers, set as users set them: by name in
any order, changed between calls, in a schedule under ``torch.compile(fullgraph=True)``."""

import itertools

import pytest
import torch

import cellc

# Every shipped cell with two rates or more, at rates other than its defaults.
TWO_RATES = {"zoneout_lstm": {"zh": 0.3, "zc": 0.05}, "awd_lstm": {"weight_drop": 0.4, "dropout_input": 0.1}}
SEED = [5, 9]


def training(rnn, x, seed=7):
    torch.manual_seed(seed)
    return rnn.train()(x)[0]


def same_masks(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_shipped_cell_with_two_rates_is_tested():
    several = set()
    for cell in cellc.shipped_cells():
        try:
            rnn = cellc.RNN(cell, 4, {"H": 5})
        except ValueError:  # cells sized otherwise (the sLSTMs: heads of size D) have no rates
            continue
        if len(rnn.rates) >= 2:
            several.add(cell)
    assert several == set(TWO_RATES)


@pytest.mark.parametrize("cell", sorted(TWO_RATES))
def test_rates_are_read_by_name_whatever_the_order_given(cell):
    rates = TWO_RATES[cell]
    x = torch.randn(3, 6, 4)
    base = cellc.RNN(cell, 4, {"H": 5}, batch_first=True, rates=rates)
    want_train, want_eval = training(base, x), base.eval()(x)[0]
    want_masks = base.cell_masks(x, torch.tensor(SEED))
    for order in itertools.permutations(rates):
        shuffled = {name: rates[name] for name in order}
        made = cellc.RNN(cell, 4, {"H": 5}, batch_first=True, rates=shuffled)
        assigned = cellc.RNN(cell, 4, {"H": 5}, batch_first=True)
        assigned.rates = shuffled
        for rnn in (made, assigned):
            rnn.load_state_dict(base.state_dict())
            assert list(rnn.rates.items()) == list(base.rates.items()), order
            assert torch.equal(training(rnn, x), want_train), order
            assert torch.equal(rnn.eval()(x)[0], want_eval), order
            assert same_masks(rnn.cell_masks(x, torch.tensor(SEED)), want_masks), order
    # The rates swapped between the names are another computation: the test can tell.
    swapped = cellc.RNN(cell, 4, {"H": 5}, batch_first=True)
    swapped.load_state_dict(base.state_dict())
    swapped.rates = dict(zip(rates, reversed(list(rates.values()))))
    assert not torch.equal(training(swapped, x), want_train)


def test_an_assignment_sets_what_it_names_and_the_defaults_for_the_rest():
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4}, rates={"zh": 0.3, "zc": 0.2})
    rnn.rates = {"zc": 0.05}
    assert rnn.rates == {"zh": 0.1, "zc": 0.05}
    rnn.rates = {}
    assert rnn.rates == {"zh": 0.1, "zc": 0.1}


@pytest.mark.parametrize("rates", [[0.1, 0.2], "zh", ("zh", 0.1), 0.1])
def test_rates_that_are_not_a_dict_are_a_type_error(rates):
    with pytest.raises(TypeError, match="rates must be a dict"):
        cellc.RNN("zoneout_lstm", 3, {"H": 4}, rates=rates)
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4})
    with pytest.raises(TypeError, match="rates must be a dict"):
        rnn.rates = rates
    with pytest.raises(TypeError, match="rates must be a dict"):
        rnn.rates = None


def test_an_unknown_or_bad_rate_is_the_constructors_error_everywhere():
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4})
    with pytest.raises(ValueError, match=r"'zx', which is not a rate of cell `zoneout_lstm` \(its rates: 'zh', 'zc'\)"):
        rnn.rates = {"zx": 0.1}
    with pytest.raises(ValueError, match=r"rate 'zh' must be a number in \[0, 1\)"):
        rnn.rates = {"zh": 1.0}
    assert rnn.rates == {"zh": 0.1, "zc": 0.1}, "a refused assignment changes nothing"
    rnn.rates["zx"] = 0.2  # an item added by hand: refused at the call, by the same message
    with pytest.raises(ValueError, match="'zx', which is not a rate of cell"):
        rnn(torch.randn(2, 3, 3))


# Compiled code draws random numbers as eager mode does only with inductor's fallback: the masks'
# seeds (two numbers from PyTorch's generator per training call) are then the same.
same_random_numbers = torch._inductor.config.patch(fallback_random=True)


@same_random_numbers
def test_a_rate_schedule_under_fullgraph_compile_is_eager_mode():
    torch._dynamo.reset()
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4}, batch_first=True)
    compiled = torch.compile(rnn, fullgraph=True)
    x = torch.randn(2, 5, 3, requires_grad=True)
    outputs = []
    for zh in (0.0, 0.2, 0.5):  # a schedule: a new value each epoch
        rnn.rates["zh"] = zh
        for mode in ("train", "eval"):
            getattr(rnn, mode)()
            torch.manual_seed(11)
            got = compiled(x)[0]
            torch.manual_seed(11)
            want = rnn(x)[0]
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            outputs.append(want)
        got.sum().backward()
    assert not torch.equal(outputs[0], outputs[2]) and not torch.equal(outputs[2], outputs[4])


def test_dropout_follows_the_attribute_as_nn_lstms_does():
    x = torch.randn(3, 6, 4)
    rnn = cellc.RNN("lstm", 4, 5, 2, batch_first=True)
    for p in (0.4, 0.7, 0.0):
        rnn.dropout = p
        made = cellc.RNN("lstm", 4, 5, 2, batch_first=True, dropout=p)
        made.load_state_dict(rnn.state_dict())
        assert torch.equal(training(rnn, x), training(made, x)), p
        torch.manual_seed(3)
        masks = cellc.draw_masks()
        assert all(torch.equal(a, b) for a, b in zip(rnn.dropout_masks(x, masks), made.dropout_masks(x, masks)))
    # At 0 nothing is dropped: training is evaluation.
    assert torch.equal(training(rnn, x), rnn.eval()(x)[0])
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\)"):
        rnn.dropout = 1.0
    assert rnn.dropout == 0.0


@same_random_numbers
def test_a_dropout_schedule_under_fullgraph_compile_is_eager_mode():
    torch._dynamo.reset()
    rnn = cellc.RNN("lstm", 3, 4, 2, batch_first=True)
    compiled = torch.compile(rnn, fullgraph=True)
    x = torch.randn(2, 5, 3, requires_grad=True)
    seen = []
    for p in (0.0, 0.3, 0.6):
        rnn.dropout = p
        torch.manual_seed(11)
        got = compiled(x)[0]
        torch.manual_seed(11)
        want = rnn(x)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.sum().backward()
        seen.append(want)
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
