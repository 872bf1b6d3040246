"""Data-parallel training with SyncBatchNorm: the same parameters on 1 rank and on 3.

A small regression network, Linear(8, 16) -> SyncBatchNorm(16) -> ReLU -> Linear(16, 1),
trained with plain SGD on a NumPy-generated batch of 32 samples. Each rank holds a slice
of the batch (11, 11 and 10 samples on 3 ranks); SyncBatchNorm normalizes with the
statistics of the whole batch, and the ranks sum their parameter gradients (an
all-reduce per gradient, and one for the loss), so every rank takes the step one process
would take on the whole batch. Run it on one process or on three:

    python examples/sync_batchnorm_data_parallel.py
    mpiexec -n 3 python -m mpi4py examples/sync_batchnorm_data_parallel.py

Either way it trains the same network in one process on the whole batch with BatchNorm1d,
and prints how far apart the two sets of parameters end up (rounding: about 1e-15).
``--save FILE`` writes the final parameters (rank 0) to an .npz file: w1, b1, w2, b2 and the
SyncBatchNorm's state_dict under "bn." (``BatchNorm1d(16).load_state_dict(np.load(FILE),
prefix="bn.")`` reads it; past "bn." the keys are torch's BatchNorm1d's); ``--batch N`` trains on
N samples instead of 32 (fewer samples than ranks leaves ranks empty: they take part with
no data). Without mpi4py (``pip install 'npnorm[mpi]'``) it runs the one-process training only.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import npnorm

try:
    from mpi4py import MPI
except ImportError:  # no MPI here: one process
    MPI = None

comm = MPI.COMM_WORLD if MPI is not None else None
rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--save", metavar="FILE", help="write the final parameters (rank 0) to an .npz file")
parser.add_argument("--batch", metavar="N", type=int, default=32, help="samples in the batch (default 32)")
args = parser.parse_args()  # every rank parses: a usage error ends every rank
if args.batch < 2:
    parser.error(f"--batch: BatchNorm trains on at least 2 samples, got {args.batch}")
if args.save and not os.path.isdir(os.path.dirname(os.path.abspath(args.save))):
    parser.error(f"--save: no folder {os.path.dirname(os.path.abspath(args.save))}")

BATCH, FEATURES, HIDDEN, STEPS, LR = args.batch, 8, 16, 60, 0.1
rng = np.random.default_rng(0)  # the same data and initial parameters on every rank
x_all = rng.standard_normal((BATCH, FEATURES)) * 2 + 1
target_all = np.sin(x_all @ rng.standard_normal(FEATURES))[:, None]  # (BATCH, 1)
init = {
    "w1": rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES),
    "b1": np.zeros(HIDDEN),
    "w2": rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN),
    "b2": np.zeros(1),
}


def train(x, target, bn, sum_over_ranks, show=False):
    """SGD on the mean squared error over the whole batch (BATCH samples), of which this
    process holds ``x``; ``sum_over_ranks`` sums a gradient over the processes."""
    p = {k: v.copy() for k, v in init.items()}
    for step in range(STEPS):
        h = x @ p["w1"] + p["b1"]  # n,HIDDEN
        a = bn(h)  # n,HIDDEN: normalized with the whole batch's statistics
        r = np.maximum(a, 0.0)  # n,HIDDEN
        pred = r @ p["w2"] + p["b2"]  # n,1
        err = pred - target  # n,1
        loss = sum_over_ranks(np.array([np.sum(err * err)]))[0] / BATCH
        dpred = 2.0 * err / BATCH  # n,1: d(loss)/d(pred), global batch size
        grads = {"w2": r.T @ dpred, "b2": dpred.sum(0)}
        dr = dpred @ p["w2"].T  # n,HIDDEN
        dh = bn.backward(dr * (a > 0))  # n,HIDDEN: bn.grads gets this rank's dweight, dbias
        grads["w1"], grads["b1"] = x.T @ dh, dh.sum(0)
        grads["bn_w"], grads["bn_b"] = bn.grads["weight"], bn.grads["bias"]
        bn.zero_grad()
        for k, g in grads.items():  # data parallel: every rank applies the summed gradient
            grads[k] = sum_over_ranks(g)
        for k in ("w1", "b1", "w2", "b2"):
            p[k] = p[k] - LR * grads[k]
        bn.weight = bn.weight - LR * grads["bn_w"]
        bn.bias = bn.bias - LR * grads["bn_b"]
        if show and rank == 0 and step % 20 == 0:
            print(f"step {step:2d}: loss {loss:.6f}")
    p.update(bn.state_dict(prefix="bn."))  # bn.weight, bn.bias, bn.running_mean, ...: torch's keys
    return p


# one process, the whole batch, plain BatchNorm: the reference
reference = train(x_all, target_all, npnorm.BatchNorm1d(HIDDEN, dtype="float64"), lambda g: g, comm is None)

if comm is None:
    print("mpi4py is not installed: trained with BatchNorm1d on one process only")
    params = reference
else:
    sizes = [len(part) for part in np.array_split(np.arange(BATCH), size)]  # 0 past BATCH ranks
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    bn = npnorm.SyncBatchNorm(HIDDEN, dtype="float64", comm=comm)

    def allreduce(g):
        return comm.allreduce(np.ascontiguousarray(g), op=MPI.SUM)

    params = train(x_all[lo:hi], target_all[lo:hi], bn, allreduce, show=True)
    sizes = comm.gather(hi - lo)
    if rank == 0:
        print(f"{size} rank(s) holding {sizes} of the {BATCH} samples, SyncBatchNorm")
    diff = max(float(np.max(np.abs(params[k] - reference[k]))) for k in params)
    worst = comm.allreduce(diff, op=MPI.MAX)
    if rank == 0:
        print(f"parameters differ from one-process BatchNorm training by at most {worst:.1e}")
        print("same parameters as one process (to 1e-12):", worst <= 1e-12)

if args.save and rank == 0:
    np.savez(args.save, **params)
