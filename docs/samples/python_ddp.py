"""cellc.RNN under DistributedDataParallel, unchanged: two processes (gloo, CPU), each on half
the batch, take the same optimiser step as one process on the whole batch."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import cellc


# ANCHOR: model
class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = cellc.RNN("lstm", 5, {"H": 7}, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * 7, 1)

    def forward(self, x, lengths):
        out, _ = self.rnn(x, lengths=lengths)
        return self.head(out).squeeze(-1)


def train_step(model, x, lengths, target):
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.arange(x.shape[1]) < lengths[:, None]          # the loss skips padding
    loss = ((model(x, lengths) - target) ** 2 * mask).sum() / len(x)   # DDP averages over ranks
    optimiser.zero_grad()
    loss.backward()                                             # DDP all-reduces the gradients
    optimiser.step()


def worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)                                        # every rank starts alike
    model = nn.parallel.DistributedDataParallel(Tagger())
    x, lengths, target = data()
    part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    train_step(model, x[part], lengths[part], target[part])
    torch.save(model.module.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
# ANCHOR_END: model


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 6, 5, generator=g)
    lengths = torch.randint(1, 7, (8,), generator=g)
    return x, lengths, torch.randn(8, 6, generator=g)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        # Forked before this process runs anything in parallel (spawn works too, and takes
        # longer to start: each process imports torch again).
        # ANCHOR: start
        mp.start_processes(worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, start_method="fork")
        # ANCHOR_END: start
        ranks = [torch.load(os.path.join(tmp, f"rank{rank}.pt")) for rank in range(2)]
    torch.manual_seed(0)
    single = Tagger()
    train_step(single, *data())
    for rank, got in enumerate(ranks):
        for name, want in single.state_dict().items():
            torch.testing.assert_close(got[name], want, atol=2e-6, rtol=1e-5, msg=f"rank {rank}: {name}")
    print("two DDP ranks on half the batch each took one process's step on the whole batch")
