"""One module per fused operation: argument checks, backend dispatch, the PyTorch path, and the Triton
path (whose kernel module is imported only inside the Triton branch)."""
