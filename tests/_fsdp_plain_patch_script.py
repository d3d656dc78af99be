"""FSDP2 ``fully_shard`` after a plain ``patch_residuals`` (no Lightning), for tests/test_rule_shapes.py.

    python tests/_fsdp_plain_patch_script.py STORE_FILE METHOD [METHOD ...]

One gloo process (a one-rank mesh: ``fully_shard`` checks the parameters' shapes the same way at any world size).
Per method: a tiny NanoGPT is patched, its logits taken, then every block and the model are sharded; the sharded
model's logits must equal the unsharded ones. Prints one line per method: ``METHOD ok`` or ``METHOD FAIL <error>``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from lightning_resctl import patch_residuals  # noqa: E402
from models import NanoGPT  # noqa: E402


def main(store: str, methods: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        for method in methods:
            torch.manual_seed(0)
            model = NanoGPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
            report = patch_residuals(model, method=method)
            with torch.no_grad():
                for name in report.new_parameters:  # away from the init: a non-trivial rule
                    p = model.get_parameter(name)
                    p.add_(0.3 * torch.randn(p.shape))
            x = torch.randint(0, 64, (2, 8))
            want = model(x).detach()
            try:
                for block in model.h:
                    fully_shard(block)
                fully_shard(model)
                got = model(x)
                torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
                got.sum().backward()
                assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
            except Exception as e:  # noqa: BLE001 - reported per method
                print(method, "FAIL", type(e).__name__, str(e).splitlines()[0], flush=True)
            else:
                print(method, "ok", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
