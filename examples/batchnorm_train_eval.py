"""BatchNorm in training and in inference: batch statistics vs running statistics.

Training normalizes each channel with the statistics of the batch and moves the
running statistics towards them; inference normalizes with the running statistics,
so a single example gets the same output whatever batch it arrives in. If torch is
installed, the same steps run in torch.nn.BatchNorm2d and the results are compared.
"""

import importlib.util

import numpy as np

import npnorm

rng = np.random.default_rng(0)
bn = npnorm.BatchNorm2d(3)  # momentum=0.1, running_mean 0, running_var 1
batches = [(rng.standard_normal((8, 3, 4, 4)) * 2 + 5).astype(np.float32) for _ in range(20)]

for x in batches:  # training: batch statistics, running statistics updated
    y = bn(x)
    bn.backward(np.ones_like(y))  # gradients of a (trivial) loss
# each step moves the running statistics 10% of the way to the batch's: after 20 steps
# they have gone 1 - 0.9**20 = 88% of the way from their start (mean 0, var 1)
moved = 1 - 0.9 ** int(bn.num_batches_tracked)
steps = int(bn.num_batches_tracked)
print(f"after {steps} batches (the running statistics have moved {moved:.0%} of the way):")
print("  running_mean", np.round(bn.running_mean, 3), f"(data mean 5: expect ~{5 * moved:.2f})")
print(
    "  running_var ",
    np.round(bn.running_var, 3),
    f"(data var 4, unbiased batch variance: expect ~{1 + 3 * moved:.2f})",
)

bn.eval()  # inference: running statistics, one example at a time is fine
single = batches[0][:1]
print(
    "eval output of one example equals its output inside a batch:",
    np.allclose(bn(single), bn(batches[0])[:1], atol=1e-6),
)

if importlib.util.find_spec("torch"):
    import torch

    ref = torch.nn.BatchNorm2d(3)
    for x in batches:
        ref(torch.from_numpy(x))
    ref.eval()
    ours = npnorm.BatchNorm2d(3)
    ours.load_state_dict(ref.state_dict())  # a real PyTorch checkpoint loads as is
    ours.eval()
    diff = np.abs(ours(batches[0]) - ref(torch.from_numpy(batches[0])).detach().numpy()).max()
    print(f"torch checkpoint loaded; eval outputs differ by at most {diff:.1e}")
    print("running stats agree with torch:", np.allclose(bn.running_var, ref.running_var.numpy(), rtol=1e-5))
