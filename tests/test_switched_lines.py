"""Lines a flag switches after the patch: a block that runs another addition than the one the patch observed
(``if self.ckpt and self.training: x = x + checkpoint(f, x)`` / ``else: x = x + f(x)``, patched with the flag off,
switched on afterwards) runs it unpatched; every rule must refuse that forward, naming the cause and the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_resctl import merge_rules, patch_residuals, unpatch_residuals
from lightning_resctl.rules import get_merge_rule
from models import TanhBranch

C = 8
METHODS = list(merge_rules())


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = TanhBranch(C)
        self.ckpt = False

    def forward(self, x):
        if self.ckpt and self.training:
            x = x + checkpoint(self.f, x, use_reentrant=False)
        else:
            x = x + self.f(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(C, C)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 5, C, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", METHODS)
def test_a_flag_switched_after_the_patch_is_refused_naming_the_cause(method):
    torch.manual_seed(0)
    model = Net()
    patch_residuals(model, method=method, example_input=(_x(),))
    model(_x(1)).sum().backward()            # as patched: runs
    model.blocks[1].ckpt = True              # e.g. a Trainer flag set after the callback patched the model
    with pytest.raises(RuntimeError, match="flag") as err:
        model(_x(1)).sum().backward()
    message = str(err.value)
    assert "patch" in message and "unpatch_residuals" in message and "blocks.1" in message
    assert "use a per-merge rule (e.g. method='rescontroller') for this model" not in message
    with torch.no_grad():                    # eval does not take the switched line: runs
        model.eval()(_x(1))
    # patched again with the flag set: runs, and the checkpointed line goes through the rule
    model.train()
    unpatch_residuals(model)
    patch_residuals(model, method=method, example_input=(_x(),))
    model(_x(1)).sum().backward()


def test_a_data_dependent_number_of_merges_still_runs_with_a_per_merge_rule():
    """What stays allowed for per-merge rules: an expression observed to run several times per call (a loop)
    runs fewer times; a block that is not called at all (layer drop) is not checked."""
    torch.manual_seed(0)
    model = Net()
    patch_residuals(model, method="rescontroller", example_input=(_x(),))
    assert get_merge_rule("rescontroller").kind == "merge"

    def skip_middle(x):
        x = model.emb(x)
        for i, block in enumerate(model.blocks):
            if i != 1:
                x = block(x)
        return model.head(x)

    assert torch.isfinite(skip_middle(_x(1))).all()


@pytest.mark.parametrize("method", ["rescontroller", "hc"])
def test_a_flag_switched_after_the_patch_is_refused_in_blocks_compiled_on_their_own(method):
    """The check holds where each block is compiled on its own (dynamo traces its hooks and merges): the switched
    block recompiles on the flag and its forward is refused as in eager code."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    patch_residuals(model, method=method, example_input=(_x(),))
    for block in model.blocks:
        block.compile(backend="aot_eager")
    model(_x(1)).sum().backward()
    model.blocks[1].ckpt = True
    with pytest.raises(RuntimeError, match="flag") as err:
        model(_x(1)).sum().backward()
    assert "blocks.1" in str(err.value)
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "per-block"])
def test_a_chain_rule_refuses_a_forward_that_skips_a_block(compiled):
    """Layer drop (a block not called) under a chain rule: eagerly the next merge is refused at once; in blocks
    compiled one by one (whose traced merges do not read their positions) the forward is refused at its end, by the
    merges' counts, naming the block whose merge did not run."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    patch_residuals(model, method="hc", example_input=(_x(),))
    if compiled:
        for block in model.blocks:
            block.compile(backend="aot_eager", fullgraph=True)
    model(_x(1)).sum().backward()

    def skip_middle(x):
        x = model.emb(x)
        for i, block in enumerate(model.blocks):
            if i != 1:
                x = block(x)
        return model.head(x)

    model.forward = skip_middle  # called through the module: the chain's hooks on it run
    with pytest.raises(RuntimeError, match="same merges in every forward") as err:
        model(_x(1))
    assert "blocks.1" in str(err.value)
    torch._dynamo.reset()
