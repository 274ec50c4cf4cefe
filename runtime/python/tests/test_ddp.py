"""``cellc.RNN`` under ``DistributedDataParallel``, unchanged: two processes on the gloo
back end (CPU), each on half the batch. After one optimiser step, the gradients and the
parameters equal those of one process on the whole batch."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import cellc

BATCH, STEPS, INPUT, HIDDEN = 8, 6, 5, 7


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = cellc.RNN("lstm", INPUT, {"H": HIDDEN}, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * HIDDEN, 1)

    def forward(self, x, lengths):
        out, _ = self.rnn(x, lengths=lengths)
        return self.head(out).squeeze(-1)


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, STEPS, INPUT, generator=g)
    lengths = torch.randint(1, STEPS + 1, (BATCH,), generator=g)
    target = torch.randn(BATCH, STEPS, generator=g)
    return x, lengths, target


def step(model, x, lengths, target, denominator):
    """One SGD step on a loss summed over sequences and divided by `denominator`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.arange(STEPS)[None, :] < lengths[:, None]
    loss = (((model(x, lengths) - target) ** 2) * mask).sum() / denominator
    opt.zero_grad()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(Model())
        x, lengths, target = data()
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        grads, params = step(model, x[part], lengths[part], target[part], BATCH / world)
        torch.save((grads, params), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_equal_one_process():
    torch.manual_seed(0)
    single = Model()
    x, lengths, target = data()
    want_grads, want_params = step(single, x, lengths, target, BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        for rank in range(2):
            grads, params = torch.load(os.path.join(tmp, f"rank{rank}.pt"))
            for (name, _), g, w in zip(single.named_parameters(), grads, want_grads):
                torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5, msg=f"rank {rank}: gradient of {name}")
            for (name, _), p, w in zip(single.named_parameters(), params, want_params):
                torch.testing.assert_close(p, w, atol=2e-6, rtol=1e-5, msg=f"rank {rank}: parameter {name}")
