"""``make gpu-check``'s first step: one line and exit 1 unless torch sees a CUDA GPU."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        import torch
    except ImportError as exc:
        print(f"make gpu-check: {sys.executable} cannot import torch ({exc}); set GPU_PY")
        return 1
    if not torch.version.cuda:
        print(
            f"make gpu-check: {sys.executable} has torch {torch.__version__}, a build without "
            "CUDA; set GPU_PY to a Python with a CUDA torch and requirements/dev.txt"
        )
        return 1
    if not torch.cuda.is_available():
        print(
            f"make gpu-check: no CUDA GPU visible to torch {torch.__version__} "
            "(torch.cuda.is_available() is False; check CUDA_VISIBLE_DEVICES and the driver)"
        )
        return 1
    name = torch.cuda.get_device_name(0)
    print(f"make gpu-check: {name}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
