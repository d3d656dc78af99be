"""Compare residual merges on a char-level GPT: the README's main job, as a script.

    python examples/compare_residuals.py                       # CPU defaults (2 seeds x 4 methods)
    python examples/compare_residuals.py --steps 1000 --seeds 3 --n-layer 24 --n-embd 256 \
        --accelerator gpu --precision bf16-mixed --batch-size 64 --block-size 256

Same flags (and ``--config file.yaml``) as ``python -m lightning_resctl compare``; the
code is :func:`lightning_resctl.compare.main`.
"""
import sys

from lightning_resctl.compare import main

if __name__ == "__main__":
    sys.exit(main())
