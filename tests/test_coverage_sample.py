"""A fixed small sample of the coverage sweep (benchmarks/coverage_hf.py), through the importable
``lightning_resctl.surgery.coverage``: each family builds from its shrunken default config and is patched with
the structurally expected merge count, bitwise ``add`` and unpatch, and trains a step under both rules."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from lightning_resctl.surgery import coverage  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (family, expected merges with 2 layers): decoder-only, encoder-only, encoder-decoder, vision, parallel
# blocks, the two families whose merges live in a free function (dropout_add), and two families that add
# one attention position bias to every layer's scores (not a merge: it once was patched as one)
SAMPLE = {"gpt2": 4, "llama": 4, "bert": 4, "bart": 10, "vit": 4, "gpt_neox": 2, "gptj": 2,
          "falcon": 2, "bloom": 4, "mpnet": 4, "cpmant": 4}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", list(SAMPLE))
def test_sample_family_is_patched_exactly(family):
    r = coverage.run_family(family, timeout=120)
    assert r.builds, r.reason
    assert (r.merges, r.expected) == (SAMPLE[family], SAMPLE[family]), (r.reason, r.expectation)
    assert r.add_bitwise and r.unpatch_bitwise
    assert r.rescontroller and r.mgr
    assert r.exact and r.status == "exact"
    if family in ("falcon", "bloom"):
        assert r.functions == ["dropout_add"]


def test_expectation_is_derived_from_the_config():
    import transformers as T

    assert coverage.expected_merges(T.LlamaConfig(num_hidden_layers=3))[0] == 6
    assert coverage.expected_merges(T.GPTNeoXConfig(num_hidden_layers=3, use_parallel_residual=True))[0] == 3
    assert coverage.expected_merges(T.GPTNeoXConfig(num_hidden_layers=3, use_parallel_residual=False))[0] == 6
    assert coverage.expected_merges(T.BartConfig(encoder_layers=1, decoder_layers=2))[0] == 2 + 6
    assert coverage.expected_merges(T.BartConfig(encoder_layers=1, decoder_layers=2), "BartForCausalLM")[0] == 4
    assert coverage.expected_merges(T.SwinConfig(depths=[1, 2], num_heads=[1, 2]))[0] == 6
    assert coverage.expected_merges(T.ConvNextConfig())[0] is None      # conv stages: no structural count
    assert coverage.expected_merges(T.GPTJConfig(n_layer=3))[0] == 3     # parallel block without a flag


def test_shrunken_config_is_small():
    cfg = coverage.shrink_config("llama")
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 32 and cfg.vocab_size == 128
    assert cfg.intermediate_size == 64 and cfg.num_attention_heads == 2


def test_failures_are_recorded_not_raised():
    r = coverage.run_family("llama", "NoSuchModelClass")
    assert r.builds is False and "cannot build" in r.reason and r.status == "skipped"
    line = coverage.summary_line([r, coverage.run_family("gpt2")])
    assert line.startswith("2 families tried, 1 patched exactly, 1 skipped with reason")


def test_command_line_writes_the_table(tmp_path):
    out = tmp_path / "coverage.md"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "coverage_hf.py"), "--families",
                           "bloom,gpt2", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 families tried, 2 patched exactly, 0 skipped with reason" in proc.stdout
    text = out.read_text()
    assert "| bloom | BloomForCausalLM | yes | 4 / 4 | yes | yes | yes | yes | exact |" in text
