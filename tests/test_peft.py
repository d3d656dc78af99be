"""PEFT on patched models (tiny random-init Llama / GPT-2, nothing downloaded): ``modules_to_save`` naming a
rule's module trains the copy that runs; the adapter folder of a patched ``PeftModel`` rebuilds the patched,
trained network (patch then LoRA, LoRA then patch)."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from lightning_resctl import get_merge_rule, merge_sites, patch_residuals  # noqa: E402

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _rule_module_name(method: str) -> str:
    """What a user names in ``modules_to_save``: a chain rule's chain module (``_resctl_hc0``)."""
    return f"{get_merge_rule(method).rule_class.chain_attr}0"


def _perturb(module: torch.nn.Module, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


METHODS = ["mgr-competitive", "attnres-block", "hc", "mhc-lite", "dwa", "laurel-pa", "kromhc"]


@pytest.mark.parametrize("method", METHODS)
def test_modules_to_save_on_the_rule_trains_the_copy_that_runs(method):
    """PEFT wraps the rule's module (``ModulesToSaveWrapper``: a frozen original and a trainable copy); the merges
    run the copy: changing it changes the logits exactly as changing the rule's module of the patched model does,
    changing the frozen original changes nothing, and the copy's parameters get gradients."""
    model = _llama()
    patch_residuals(model, method=method, example_input=IDS)
    reference = copy.deepcopy(model).eval()
    name = _rule_module_name(method)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=[name]))
    peft_model.eval()
    wrappers = [m for n, m in peft_model.named_modules() if n.endswith(name)
                and type(m).__name__ == "ModulesToSaveWrapper"]
    assert wrappers, f"PEFT wrapped no module named {name}"
    torch.testing.assert_close(_logits(peft_model), _logits(reference))

    for i, wrapper in enumerate(wrappers):
        _perturb(wrapper.modules_to_save["default"], seed=3 + i)
    for i, m in enumerate(m for n, m in reference.named_modules() if n.endswith(name)):
        _perturb(m, seed=3 + i)
    torch.testing.assert_close(_logits(peft_model), _logits(reference))

    before = _logits(peft_model)
    for wrapper in wrappers:
        _perturb(wrapper.original_module, seed=11)
    torch.testing.assert_close(_logits(peft_model), before)

    peft_model.train()
    peft_model(input_ids=IDS, labels=IDS).loss.backward()
    for wrapper in wrappers:
        grads = [p.grad for p in wrapper.modules_to_save["default"].parameters()]
        assert grads and all(g is not None for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)
        assert all(p.grad is None for p in wrapper.original_module.parameters())
    assert merge_sites(peft_model)


def _train(model, steps: int = 2) -> None:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()


def _reloaded(folder, method: str):
    """The documented reload, for both orders: the base model patched as it was, then the adapter."""
    base = _llama()
    patch_residuals(base, method=method, example_input=IDS)
    return PeftModel.from_pretrained(base, folder)


@pytest.mark.parametrize("method", ["hc", "mgr-competitive", "ddl"])
def test_lora_then_patch_the_adapter_folder_rebuilds_the_trained_patched_network(tmp_path, method):
    """``patch_residuals(peft_model)``: the rule's modules join the adapter's ``modules_to_save`` (they train and
    are saved with the LoRA weights); the reload gives the trained model's logits. The order that loses them (the
    adapter loaded into the unpatched base, the patch after) is refused, naming the order that works."""
    peft_model = get_peft_model(_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    fresh = copy.deepcopy(peft_model)
    patch_residuals(peft_model, method=method, example_input=IDS)
    patch_residuals(fresh, method=method, example_input=IDS)
    _train(peft_model)
    trained = _logits(peft_model.eval())
    assert not torch.allclose(trained, _logits(fresh.eval()))
    peft_model.save_pretrained(tmp_path)
    torch.testing.assert_close(_logits(_reloaded(tmp_path, method)), trained)

    unpatched = PeftModel.from_pretrained(_llama(), tmp_path)
    with pytest.raises(RuntimeError, match="patch the base model") as err:
        patch_residuals(unpatched, method=method, example_input=IDS)
    assert "PeftModel.from_pretrained" in str(err.value)


def test_patch_then_lora_with_the_rule_in_modules_to_save_reloads_the_trained_network(tmp_path):
    model = _llama()
    patch_residuals(model, method="mgr-competitive", example_input=IDS)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                  modules_to_save=["_resctl_mgr0"]))
    _train(peft_model)
    trained = _logits(peft_model.eval())
    peft_model.save_pretrained(tmp_path)
    torch.testing.assert_close(_logits(_reloaded(tmp_path, "mgr-competitive")), trained)


def test_hf_trainer_with_the_callback_on_a_peft_model_saves_a_folder_that_reloads(tmp_path):
    from transformers import Trainer, TrainingArguments

    from lightning_resctl import ResidualTrainerCallback

    peft_model = get_peft_model(_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    data = [{"input_ids": r, "labels": r} for r in torch.randint(0, 64, (8, 8), generator=torch.Generator()
                                                                  .manual_seed(0))]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=peft_model, args=args, train_dataset=data,
                      callbacks=[ResidualTrainerCallback(method="hc", dirpath=str(tmp_path / "figs"))])
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    trained = _logits(peft_model.eval())
    torch.testing.assert_close(_logits(_reloaded(tmp_path / "adapter", "hc")), trained)
