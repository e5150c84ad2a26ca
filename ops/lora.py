"""
LoRA (--lora-rank) through PEFT: adapters on the policy's linear layers, trained alone; the reference is the same
model with its adapters off (no second copy); HF searchers get the merged weights W + B A under the plain model's
names, vLLM searchers the adapters alone (--lora-sync adapter, the default: ops/vllm_backend.py serves them as a
LoRA), and final/ is saved merged, so that from_pretrained loads it. An operation for memory, not the algorithm:
ops.models.load_trainer_models, tba.publish and the checkpoints reach it.
"""

import json
import os
import re

import torch


def add_lora(model, cfg):
    """LoRA adapters on every linear layer (or --lora-target-modules) through PEFT: only they train."""
    from peft import LoraConfig, get_peft_model
    targets = "all-linear" if cfg.lora_target_modules == "all-linear" else cfg.lora_target_modules.split(",")
    return get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


def is_lora(model):
    return hasattr(model, "peft_config")


@torch.no_grad()
def plain_state_dict(model, merged=True):
    """The weights under the plain model's names (what a searcher's model and from_pretrained expect): a LoRA
    model's base weights, with the adapters' W + B A merged in (merged=True) or not (the reference)."""
    if not is_lora(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model()
    deltas = {f"{name}.weight": m.get_delta_weight(m.active_adapters[0]) for name, m in base.named_modules()
              if isinstance(m, LoraLayer)} if merged else {}
    plain = {}
    for key, value in base.state_dict().items():
        if "lora_" not in key:
            key = key.replace(".base_layer", "")
            plain[key] = value + deltas[key] if key in deltas else value
    return plain


class Merged:
    """What the searchers receive of a LoRA policy: its merged weights under the plain names (`state_dict`)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return plain_state_dict(self.model)


class Adapters:
    """What vLLM searchers receive of a LoRA policy under --lora-sync adapter: its adapters alone (every lora_A and
    lora_B), under the names PEFT saves them with in adapter_model.safetensors. RhoMath-1B with rank-16 adapters
    on every linear layer: 12.6 M parameters a sync against 1.1 B merged (docs/scaling.md)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", k): v for k, v in self.model.state_dict().items()
                if ".lora_A." in k or ".lora_B." in k}


def adapter_sync(cfg):
    """Whether a sync sends the adapters alone: LoRA with vLLM searchers, unless --lora-sync merged."""
    return bool(cfg.lora_rank) and cfg.backend == "vllm" and cfg.lora_sync == "adapter"


def for_searchers(cfg, policy):
    """What a publish sends the searchers of `policy`: the model itself, or for LoRA its merged weights, or its
    adapters alone (`adapter_sync`)."""
    if not is_lora(policy):
        return policy
    return Adapters(policy) if adapter_sync(cfg) else Merged(policy)


def save_model(model, path, dtype=None):
    """save_pretrained, a LoRA model merged: a directory AutoModelForCausalLM.from_pretrained loads. `dtype`: its
    floating-point tensors cast to it (config.json says so), e.g. the dtype of the checkpoint the run started from;
    None: as the model holds them."""
    base, state = (model.get_base_model(), plain_state_dict(model)) if is_lora(model) else (model, model.state_dict())
    if dtype is not None:
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    base.save_pretrained(path, state_dict=state)
    if dtype is not None:  # (save_pretrained writes the dtype the model holds)
        config = os.path.join(path, "config.json")
        with open(config) as f:
            saved = json.load(f)
        with open(config, "w") as f:
            json.dump({**saved, "dtype": str(dtype).removeprefix("torch.")}, f, indent=2, sort_keys=True)


class AdaptersOff:
    """The reference of a LoRA run: the policy with its adapters disabled, so no second copy of the model. It has
    what the trainer, the searchers and checkpoints ask of a reference."""

    def __init__(self, model):
        self.model, self.config = model, model.get_base_model().config

    def forward(self, input_ids, logits_to_keep=0, **inputs):
        with self.model.disable_adapter():
            return self.model(input_ids=input_ids, logits_to_keep=logits_to_keep, **inputs)

    __call__ = forward

    @property
    def device(self):
        return self.model.device

    def parameters(self):
        return (p for name, p in self.model.named_parameters() if "lora_" not in name)

    def state_dict(self):
        return plain_state_dict(self.model, merged=False)

    def load_state_dict(self, tensors, strict=True):
        """Copy plain-named weights into the base weights; returns (missing, unexpected) like torch's."""
        own = self.state_dict()
        with torch.no_grad():
            for key in own.keys() & tensors.keys():
                own[key].copy_(tensors[key])
        return sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())

    def save_pretrained(self, path):
        self.model.get_base_model().save_pretrained(path, state_dict=self.state_dict())

    def requires_grad_(self, flag):
        return self  # the base weights of a PEFT model are frozen already
