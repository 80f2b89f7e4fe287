"""``apex.mlp``: a multi-layer perceptron whose layers are GEMMs with the bias and activation fused in."""

from apex.mlp.mlp import MLP, MlpFunction, mlp_function

__all__ = ["MLP", "MlpFunction", "mlp_function"]
