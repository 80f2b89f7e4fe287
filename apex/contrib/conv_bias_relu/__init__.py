"""Apex's ``apex.contrib.conv_bias_relu``: convolution + bias (+ mask) (+ ReLU) blocks on PyTorch's convolution."""

from apex.contrib.conv_bias_relu.conv_bias_relu import ConvBias, ConvBiasMaskReLU, ConvBiasReLU, ConvFrozenScaleBiasReLU

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU"]
