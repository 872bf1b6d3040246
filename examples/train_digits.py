"""Train an MLP and a small conv net on handwritten digits with every npnorm layer, in NumPy alone.

The training code is npnorm/demo/train_digits.py: hand-written Linear, Conv2d, ReLU and
softmax cross-entropy with their backward passes, the two networks with a choice of norm,
SGD with momentum and the training loop, written to be read top to bottom. It lives inside
the package so that `python -m npnorm demo` (which adds sweeps and figures) runs the very same
code from an installed wheel; this script runs its main():

1. npnorm.gradcheck on every layer the networks use (hand-written and npnorm's norms), and a
   finite-difference check of a whole network with its loss;
2. one training run per norm on scikit-learn's digits (MLP: none, BatchNorm1d, LayerNorm,
   RMSNorm; conv net: none, BatchNorm2d, GroupNorm, InstanceNorm2d) and a table of the final
   training loss and held-out accuracy.

Needs scikit-learn for the data: pip install "npnorm[demo]". Options: --quick, --epochs N, --seed N.
"""

import sys

from npnorm.demo.train_digits import main

if __name__ == "__main__":
    sys.exit(main())
