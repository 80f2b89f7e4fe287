"""``python -m apex``: the environment to paste into a bug report."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys


def report() -> str:
    import torch

    import apex
    from apex import _backend, _hardware

    lines = [
        f"apex:            {apex.__version__} ({os.path.dirname(apex.__file__)})",
        f"torch:           {torch.__version__}",
    ]
    if importlib.util.find_spec("triton") is not None:
        import triton

        lines.append(f"triton:          {triton.__version__}")
    else:
        lines.append("triton:          not installed (pip install 'apex[triton]' for the GPU kernels)")
    lines += [
        f"python:          {sys.version.split()[0]} ({platform.platform()})",
        f"APEX_BACKEND:    {os.environ.get('APEX_BACKEND', '(unset)')} -> requested {_backend.current_backend()!r}",
        f"interpreter:     {'on' if _backend.interpreting() else 'off'} (TRITON_INTERPRET)",
        f"cpu threads:     {torch.get_num_threads()}",
    ]
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for dev in devices:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
        try:
            choice = _backend.select(torch.empty(0, device=dev))
        except RuntimeError as e:
            choice = f"error: {e}"
        lines.append(f"backend on {dev}: {choice} ({name})")
        try:
            cap = _hardware.capability(dev)
            fast = ", ".join(str(d).replace("torch.", "") for d in cap.fast)
            lines.append(f"fast dtypes on {dev}: {fast} ({cap.reason})")
            if dev.type == "cpu" and not cap.has(torch.bfloat16):
                lines.append(f"bf16 on {dev}:      {_hardware.measure_slowdown(torch.bfloat16).describe()}")
        except RuntimeError as e:
            lines.append(f"fast dtypes on {dev}: unknown ({e})")
    if torch.cuda.is_available():
        hip = getattr(torch.version, "hip", None)
        lines.append(f"gpu runtime:     {'ROCm ' + hip if hip else 'CUDA ' + str(torch.version.cuda)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
