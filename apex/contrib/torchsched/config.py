"""Configuration of the ``torchsched`` backend (Apex's names and environment variables).

Patch with ``apex.contrib.torchsched.config.patch(...)`` (PyTorch's config-module helpers). Multi-stream
scheduling is not implemented in this port (see :mod:`apex.contrib.torchsched.backend`), so ``num_streams``,
``skip_post_grad_graph_ids`` and ``reuse_cuda_event`` are accepted for compatibility and have no effect.
"""

import os
import sys

# Debug logging of the backend's decisions (TORCH_SCHED_DEBUG=1).
debug = os.getenv("TORCH_SCHED_DEBUG", "0") == "1"

# Run the pre-grad pattern passes named in pre_grad_pass_options.
enable_pre_grad_pass = False

# Pre-grad passes: "cudnn_layer_norm" replaces F.layer_norm with torch.ops.cudnn.layer_norm.
pre_grad_pass_options: list[str] = ["cudnn_layer_norm"]

# Number of CUDA streams for multi-stream scheduling (no effect here).
num_streams = int(os.getenv("TORCH_SCHED_NUM_STREAMS", "8"))

# Post-grad graph ids to leave on one stream (no effect here); TORCH_SCHED_SKIP_GRAPH_IDS="1,3-5".
skip_post_grad_graph_ids: set[int] = {
    i
    for part in os.getenv("TORCH_SCHED_SKIP_GRAPH_IDS", "").split(",") if part.strip()
    for i in (range(int(part.split("-")[0]), int(part.split("-")[1]) + 1) if "-" in part else (int(part),))
}

# Reuse CUDA events between streams (no effect here).
reuse_cuda_event: bool = os.getenv("TORCH_SCHED_REUSE_CUDA_EVENT", "1") == "1"

from torch.utils._config_module import install_config_module  # noqa: E402

# Adds patch, save_config, ... (as Apex's config module).
install_config_module(sys.modules[__name__])
