"""Issue 10, rewrite side: expressions that used to patch and then fail (walrus, comprehensions), a pickled
patched model whose source file was edited, argument checks of unpatch_residuals, and branch labels."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_resctl.surgery import merge_sites, patch_residuals, unpatch_residuals

C = 16
SEQ = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(3))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WalrusBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        self.f, self.g = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        x = x + self.f(h := self.ln(x))
        x = x + self.g(self.ln(x))
        return x * h               # h, assigned inside the first merge, is read here


class ComprehensionBlock(nn.Module):
    """A generator expression and a list comprehension inside the update operand."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(C, C) for _ in range(2)])
        self.proj = nn.Linear(2 * C, C)

    def forward(self, x):
        x = x + sum(f(x) for f in self.branches)
        x = x + self.proj(torch.cat([f(x) for f in self.branches], dim=-1))
        return x


class MergeInComprehension(nn.Module):
    """The merge itself runs inside a list comprehension (its own code object in Python 3.11)."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(C, C)

    def forward(self, xs):
        return torch.stack([x + self.f(x) for x in xs])


def _bitwise_add(make, x, n):
    torch.manual_seed(0)
    model = make()
    run = (lambda m: m(*x)) if isinstance(x, tuple) else (lambda m: m(x))
    before = run(model)
    report = patch_residuals(model, method="add", example_input=x)
    assert len(report.sites) == n, report
    assert torch.equal(run(model), before)
    unpatch_residuals(model)
    assert torch.equal(run(model), before)
    return report


def test_walrus_in_a_merge():
    report = _bitwise_add(WalrusBlock, SEQ, 2)
    assert report.sites[0].source_line == "x = x + self.f(h := self.ln(x))"
    m = WalrusBlock()
    patch_residuals(m, method="rescontroller", example_input=SEQ, backend="torch")
    assert torch.isfinite(m(SEQ)).all()


def test_comprehensions_inside_an_operand():
    report = _bitwise_add(ComprehensionBlock, SEQ, 2)
    assert not any("ValueError" in s.reason or "cannot rewrite" in s.reason for s in report.skipped)


def test_merge_inside_a_list_comprehension():
    xs = [SEQ[0], SEQ[1]]
    report = _bitwise_add(MergeInComprehension, (xs,), 2)
    assert {s.source_line for s in report.sites} == {"return torch.stack([x + self.f(x) for x in xs])"}


def test_unpatch_residuals_rejects_a_non_module():
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        unpatch_residuals("x")


# ---------------------------------------------------------------------------------------------- pickled model
MODEL_SRC = '''
import torch
from torch import nn


def residual_add(x, u):
    return x + u


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln = nn.LayerNorm(c)
        self.attn = nn.Linear(c, c)
        self.mlp = nn.Linear(c, c)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        x = residual_add(x, self.mlp(x))
        return x


class Net(nn.Module):
    def __init__(self, c=8, n=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(c) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
'''

LOAD = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from lightning_resctl.surgery import merge_sites
    model = torch.load(sys.argv[2], weights_only=False)
    x, want = torch.load(sys.argv[3])
    out = model(x)
    print("SITES", len(merge_sites(model)), "EQUAL", torch.equal(out, want))
''')


def _save_patched(tmp_path, method):
    pkg = tmp_path / "src"
    pkg.mkdir()
    (pkg / "resctl_pickled_model.py").write_text(MODEL_SRC)
    script = textwrap.dedent(f'''
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from resctl_pickled_model import Net
        from lightning_resctl.surgery import patch_residuals
        torch.manual_seed(0)
        model = Net()
        x = torch.randn(2, 3, 8)
        report = patch_residuals(model, method={method!r}, example_input=x, **({{"backend": "torch"}}
                                 if {method!r} == "rescontroller" else {{}}))
        assert len(report.sites) == 4, report
        torch.save(model, sys.argv[2])
        torch.save((x, model(x).detach()), sys.argv[3])
    ''')
    paths = [str(pkg), str(tmp_path / "model.pt"), str(tmp_path / "io.pt")]
    _run(script, paths)
    return pkg / "resctl_pickled_model.py", paths


def _run(script, args, check=True):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("method", ["add", "rescontroller"])
def test_pickled_patched_model_reloads_after_an_unrelated_edit(tmp_path, method):
    src, paths = _save_patched(tmp_path, method)
    text = src.read_text()
    # lines added above every merge (and above the helper function), an expression reformatted
    text = "# a comment line added after saving\n\n" + text
    text = text.replace("    def forward(self, x):\n        x = x + self.attn",
                        "    def forward(self, x):\n        # another comment\n        x = x  +  self.attn")
    text = text.replace("def residual_add(x, u):\n", "def residual_add(x, u):\n    # a comment\n")
    src.write_text(text)
    out = _run(LOAD, paths).stdout
    assert "SITES 4 EQUAL True" in out


def test_pickled_patched_model_with_swapped_operands_fails_naming_the_site(tmp_path):
    src, paths = _save_patched(tmp_path, "add")
    src.write_text(src.read_text().replace("x = x + self.attn(self.ln(x))", "x = self.attn(self.ln(x)) + x"))
    proc = _run(LOAD, paths, check=False)
    assert proc.returncode != 0
    assert "_resctl_site0" in proc.stderr and "x + self.attn(self.ln(x))" in proc.stderr
    assert "no longer in the source" in proc.stderr


def test_pickled_function_merge_with_a_changed_function_fails_naming_the_site(tmp_path):
    src, paths = _save_patched(tmp_path, "add")
    src.write_text(src.read_text().replace("return x + u", "return u + x"))
    proc = _run(LOAD, paths, check=False)
    assert proc.returncode != 0
    assert "residual_add" in proc.stderr and "`x + u`" in proc.stderr and "no longer in the source" in proc.stderr


# ---------------------------------------------------------------------------------------------- branch labels
def test_branch_labels_nanogpt():
    from benchmarks.models import NanoGPT

    model = NanoGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    idx = torch.randint(0, 32, (2, 8))
    report = patch_residuals(model, method="add", example_input=idx)
    assert [s.branch for s in report.sites] == ["attn", "mlp"] * 2
    assert [s.branch for s in merge_sites(model)] == ["attn", "mlp"] * 2
    assert [d["branch"] for d in report.to_dict()["sites"]] == ["attn", "mlp"] * 2
    assert "attn" in str(report).splitlines()[3]


def test_branch_labels_conv_and_unnamed():
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
            self.f = nn.Linear(4, 4)

        def forward(self, x):
            x = x + self.body(x)
            y = x.transpose(1, 3)
            return y + self.f(y)

    report = patch_residuals(Res(), method="add", example_input=torch.randn(1, 4, 5, 5))
    assert [s.branch for s in report.sites] == ["conv", ""]


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_branch_labels_hf(arch):
    T = transformers
    if arch == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                                 max_position_embeddings=32))
    report = patch_residuals(model, method="add", example_input=torch.randint(0, 64, (2, 8)))
    assert [s.branch for s in report.sites] == ["attn", "mlp"] * 2
