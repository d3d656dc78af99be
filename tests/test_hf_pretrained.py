"""save_pretrained / from_pretrained folders of patched transformers models (tiny random-init configs, tmp_path,
nothing downloaded): the patch travels in the folder and ``lightning_resctl.from_pretrained`` rebuilds it."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import lightning_resctl  # noqa: E402
from lightning_resctl import (  # noqa: E402
    get_patch_report,
    load_unpatched_state_dict,
    merge_sites,
    patch_from_checkpoint,
    patch_from_state_dict,
    patch_residuals,
    unpatch_residuals,
)
from lightning_resctl.surgery.checkpoint import load_tied_state_dict  # noqa: E402

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _gpt2():
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _llama():
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _trained(model, method, **options):
    """``model`` patched with ``method`` and trained two steps, so that no weight (the rule's new ones included)
    keeps the value a fresh patch would give it."""
    patch_residuals(model, method=method, example_input=IDS, **options)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


CASES = [("gpt2", _gpt2, "rescontroller", {}), ("gpt2", _gpt2, "mgr-competitive", {"streams": 2}),
         ("llama", _llama, "hc", {}), ("llama", _llama, "mgr", {"streams": 2}),
         ("gpt2", _gpt2, "laurel", {}), ("gpt2", _gpt2, "ddl", {}), ("llama", _llama, "dwa", {}),
         ("llama", _llama, "laurel-pa", {}), ("llama", _llama, "kromhc", {})]


@pytest.mark.parametrize("name,make,method,options", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_from_pretrained_rebuilds_the_patched_model_bitwise(tmp_path, name, make, method, options):
    model = _trained(make(), method, **options)
    model.save_pretrained(tmp_path)
    loaded = lightning_resctl.from_pretrained(AutoModelForCausalLM, tmp_path)
    assert type(loaded) is type(model)
    assert get_patch_report(loaded).method == method
    assert len(merge_sites(loaded)) == len(merge_sites(model))
    assert set(loaded.state_dict()) == set(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    # the tie transformers makes is kept (GPT-2 ties lm_head to the token embedding; Llama's config does not)
    tied = model.config.tie_word_embeddings
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == tied


def test_save_pretrained_records_the_patch_in_config_json(tmp_path):
    model = _gpt2()
    patch_residuals(model, method="mgr-competitive", example_input=IDS, streams=2)
    model.save_pretrained(tmp_path)
    note = json.loads((tmp_path / "config.json").read_text())["lightning_resctl"]
    assert note["method"] == "mgr-competitive"
    assert note["options"]["streams"] == 2
    assert note["merges"] == 4
    assert note["base_model_type"] == "gpt2"
    assert "lightning_resctl.from_pretrained(AutoModelForCausalLM" in note["load_with"]
    unpatch_residuals(model)  # the note goes with the patch
    model.save_pretrained(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "lightning_resctl" not in plain and plain["model_type"] == "gpt2"


def test_unpatched_folder_loads_unpatched(tmp_path):
    model = _gpt2().eval()
    model.save_pretrained(tmp_path)
    loaded = lightning_resctl.from_pretrained(AutoModelForCausalLM, tmp_path)
    assert get_patch_report(loaded) is None and not merge_sites(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


AUTO_CASES = [("gpt2", _gpt2, "rescontroller", {}), ("gpt2", _gpt2, "mgr-competitive", {"streams": 2}),
              ("llama", _llama, "hc", {}), ("gpt2", _gpt2, "ddl", {})]


@pytest.mark.parametrize("name,make,method,options", AUTO_CASES, ids=[f"{c[0]}-{c[2]}" for c in AUTO_CASES])
def test_auto_classes_load_a_patched_folder_as_the_patched_network(tmp_path, name, make, method, options):
    """``import lightning_resctl`` (above) registers the folder's model type: the Auto classes, as the
    lm-evaluation-harness, scripts and pipelines call them, build the patched, trained network."""
    model = _trained(make(), method, **options)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "lightning_resctl"
    assert model.config.model_type == name           # in memory the config is the model's own
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model) and get_patch_report(loaded).method == method
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    assert loaded.config.model_type == name
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == "lightning_resctl"


_LOAD_IN_A_FRESH_PROCESS = """
import sys, torch
if sys.argv[4] == "aware":
    import lightning_resctl          # before transformers: registers once transformers' Auto classes load
from transformers import AutoModelForCausalLM
try:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
except ValueError as err:
    print("REFUSED", err)
    sys.exit(0)
sites = [n for n, _ in model.named_modules() if "_resctl_site" in n]
with torch.no_grad():
    print("LOADED", len(sites), float((model(torch.load(sys.argv[2])).logits - torch.load(sys.argv[3])).abs().max()))
"""


def test_a_loader_that_does_not_know_the_patch_fails_loudly_and_an_aware_one_builds_it(tmp_path):
    """Fresh processes. transformers alone: the folder's model type is unknown, so ``AutoModelForCausalLM
    .from_pretrained`` raises (naming it) instead of building the unpatched network. ``import lightning_resctl``
    first, transformers after: the same call builds the patched network (the logits of the trained model). MGR's
    eager torch path in both processes: exact, whenever a background compile lands."""
    import subprocess
    import sys

    model = _trained(_gpt2(), "mgr-competitive", streams=2, backend="torch-eager")
    model.save_pretrained(tmp_path / "m")
    torch.save(IDS, tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(model(IDS).logits, tmp_path / "logits.pt")
    args = [str(tmp_path / "m"), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")]
    for mode, expected in (("unaware", "REFUSED"), ("aware", "LOADED 4 0.0")):
        out = subprocess.run([sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, *args, mode], capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert expected in out.stdout and (mode == "aware" or "lightning_resctl" in out.stdout), out.stdout[-2000:]


class _Holder(torch.nn.Module):
    """A LightningModule's shape: the transformers model is its ``self.model``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def test_a_patch_of_a_module_holding_a_transformers_model_marks_the_inner_models_folder(tmp_path):
    """``ResidualControlCallback`` patches the LightningModule, not its ``self.model``. A ``save_pretrained`` of that
    inner model wrote a plain GPT-2 ``config.json``: an Auto class then built the unpatched network, its load report
    listing the patch's keys as UNEXPECTED (a silently different network). Its folder must say it is patched, so
    transformers alone refuses it (as above) and the aware loader raises (the records name paths under the holder:
    docs/transformers.md, "Not covered"); unpatched, the note goes."""
    holder = _Holder(_gpt2())
    report = patch_residuals(holder, method="rescontroller", example_input=IDS)
    holder.model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["model_type"] == "lightning_resctl", saved["model_type"]
    assert saved["lightning_resctl"]["base_model_type"] == "gpt2"
    assert saved["lightning_resctl"]["merges"] == len(report.sites) == 4
    assert "_Holder" in saved["lightning_resctl"]["load_with"]
    with pytest.raises(ValueError, match="renamed"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    unpatch_residuals(holder)
    holder.model.save_pretrained(tmp_path / "after")
    saved = json.loads((tmp_path / "after" / "config.json").read_text())
    assert saved["model_type"] == "gpt2" and "lightning_resctl" not in saved


def test_a_class_loader_of_a_patched_folder_warns_and_a_resave_is_loaded_as_saved(tmp_path):
    """What stays: a class's own loader (``GPT2LMHeadModel.from_pretrained``) builds the unpatched class, with
    transformers' model-type warning and load report (docs/limits.md); saved again, the folder has the note but no
    sites, and the loader loads it as saved (unpatched) and says so."""
    model = _trained(_gpt2(), "rescontroller")
    model.save_pretrained(tmp_path)
    plain = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert not merge_sites(plain)
    with torch.no_grad():
        assert not torch.equal(plain(IDS).logits, model(IDS).logits)
    assert "lightning_resctl.from_pretrained" in plain.config.lightning_resctl["load_with"]
    plain.save_pretrained(tmp_path / "again")
    with pytest.warns(UserWarning, match="no merge site"):
        again = lightning_resctl.from_pretrained(AutoModelForCausalLM, tmp_path / "again")
    assert not merge_sites(again)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, plain(IDS).logits)


class _HFLMStandIn:
    """The part of lm-evaluation-harness' ``HFLM(pretrained=model_object)`` an evaluation runs: the model object
    as given, scored by the log-likelihood of continuations (``loglikelihood``)."""

    def __init__(self, pretrained):
        assert not isinstance(pretrained, str)
        self.model = pretrained.eval()

    def loglikelihood(self, context: torch.Tensor, continuation: torch.Tensor) -> float:
        ids = torch.cat([context, continuation])[None]
        with torch.no_grad():
            logp = torch.log_softmax(self.model(ids).logits[0, :-1].double(), -1)
        targets = ids[0, 1:][-len(continuation):]
        return float(logp[-len(continuation):].gather(-1, targets[:, None]).sum())


def test_evaluation_harness_scores_the_patched_network(tmp_path):
    """The documented evaluation path (docs/transformers.md): the folder loaded by the Auto class (lightning_resctl
    imported) and handed to the harness as a model object scores exactly what the trained model scores."""
    model = _trained(_gpt2(), "mgr-competitive", streams=2)
    model.save_pretrained(tmp_path)
    context, continuation = IDS[0, :5], IDS[0, 5:]
    expected = _HFLMStandIn(model).loglikelihood(context, continuation)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert _HFLMStandIn(loaded).loglikelihood(context, continuation) == expected
    unpatched = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert _HFLMStandIn(unpatched).loglikelihood(context, continuation) != expected


def test_loader_keeps_hf_kwargs_and_loading_info(tmp_path):
    model = _trained(_gpt2(), "rescontroller")
    model.save_pretrained(tmp_path)
    loaded, info = lightning_resctl.from_pretrained(AutoModelForCausalLM, tmp_path, dtype=torch.float64,
                                                    output_loading_info=True)
    assert loaded.dtype == torch.float64 and get_patch_report(loaded) is not None
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_loader_rejects_a_class_without_from_pretrained(tmp_path):
    with pytest.raises(TypeError, match="model_class"):
        lightning_resctl.from_pretrained(torch.nn.Linear, tmp_path)


# ------------------------------------------------------------------ tied weights (state dicts of save_pretrained)
def test_patch_from_state_dict_loads_a_save_pretrained_state_dict_with_tied_weights(tmp_path):
    model = _trained(_gpt2(), "mgr-competitive", streams=2)
    model.save_pretrained(tmp_path)
    state_dict = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in state_dict  # transformers drops the tied copy
    fresh = _gpt2()
    patch_from_state_dict(fresh, state_dict, example_input=IDS)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    with torch.no_grad():
        assert torch.equal(fresh.eval()(IDS).logits, model(IDS).logits)


def test_patch_from_state_dict_still_refuses_a_missing_weight_that_is_not_tied(tmp_path):
    model = _trained(_gpt2(), "rescontroller")
    model.save_pretrained(tmp_path)
    state_dict = load_file(tmp_path / "model.safetensors")
    del state_dict["transformer.ln_f.weight"]
    with pytest.raises(RuntimeError, match="transformer.ln_f.weight"):
        patch_from_state_dict(_gpt2(), state_dict, example_input=IDS)


def test_patch_from_checkpoint_then_tied_load(tmp_path):
    model = _trained(_gpt2(), "rescontroller")
    model.save_pretrained(tmp_path)
    state_dict = load_file(tmp_path / "model.safetensors")
    fresh = _gpt2()
    assert patch_from_checkpoint(fresh, state_dict, example_input=IDS) is not None
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # the patch keeps the tie
    load_tied_state_dict(fresh, state_dict)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(IDS).logits, model(IDS).logits)


def test_load_unpatched_state_dict_accepts_the_tied_weight_left_out(tmp_path):
    plain = _gpt2().eval()
    plain.save_pretrained(tmp_path)
    state_dict = load_file(tmp_path / "model.safetensors")
    model = _gpt2()
    patch_residuals(model, method="add", example_input=IDS)
    load_unpatched_state_dict(model, state_dict)
    with torch.no_grad():
        assert torch.equal(model.eval()(IDS).logits, plain(IDS).logits)
