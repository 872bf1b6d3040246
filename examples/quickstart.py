"""Forward, backward, gradients and a gradient check with npnorm's LayerNorm and RMSNorm."""

import numpy as np

import npnorm

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 16, 32)).astype(np.float32)  # (batch, tokens, features)

ln = npnorm.LayerNorm(32)  # weight (32,) ones, bias (32,) zeros
y = ln(x)  # forward: saves x and the per-row mean and rstd
print(f"LayerNorm output rows: mean {abs(y.mean(-1)).max():.2e}, var {y.var(-1).mean():.4f}")

dy = rng.standard_normal(y.shape).astype(np.float32)  # upstream gradient
dx = ln.backward(dy)  # input gradient; parameter gradients accumulate in ln.grads
print("dx", dx.shape, "| grads:", {k: v.shape for k, v in ln.grads.items()})
print(f"dx sums to zero along each row: {abs(dx.sum(-1)).max():.1e}")
ln.zero_grad()

rms = npnorm.RMSNorm(32)
print(f"RMSNorm output mean square: {(rms(x) ** 2).mean():.4f}")

# finite differences against the analytical backward, in float64, on small inputs
print("gradcheck LayerNorm:", npnorm.gradcheck(npnorm.LayerNorm(8), rng.standard_normal((3, 8))))
print("gradcheck RMSNorm:  ", npnorm.gradcheck(npnorm.RMSNorm(8), rng.standard_normal((3, 8))))
