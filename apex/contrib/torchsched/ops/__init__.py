"""Custom operators of ``torchsched``: ``torch.ops.cudnn.layer_norm`` and its backward."""

from apex.contrib.torchsched.ops import layer_norm

__all__ = ["layer_norm"]
