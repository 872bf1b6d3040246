"""Training on real data with npnorm's layers: the code behind ``python -m npnorm demo``.

- ``train_digits``: the readable training code (hand-written Linear, Conv2d, ReLU and
  softmax cross-entropy with their backward passes, the networks, SGD, the training loop,
  the gradient checks); ``examples/train_digits.py`` runs it.
- ``experiments``: the runs behind the figures (per-norm curves, BatchNorm's batch-size
  sweep, the learning-rate sweep, per-layer statistics).
- ``figures``: the figures (matplotlib, non-interactive).
- ``cli``: ``python -m npnorm demo``.

Importing this package needs only NumPy; the data need scikit-learn, the figures
matplotlib and the progress bars tqdm (the ``demo`` extra).
"""
