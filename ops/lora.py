"""
LoRA (--lora-rank) through PEFT: adapters on the policy's linear layers, trained alone; the reference is the same
model with its adapters off (no second copy); the searchers get the merged weights W + B A under the plain
model's names, and final/ is saved merged, so that from_pretrained loads it. An operation for memory, not the
algorithm: ops.models.load_trainer_models, tba.publish and the checkpoints reach it.
"""

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


def for_searchers(policy):
    return Merged(policy) if is_lora(policy) else policy


def save_model(model, path):
    """save_pretrained, a LoRA model merged: a directory AutoModelForCausalLM.from_pretrained loads."""
    if is_lora(model):
        model.get_base_model().save_pretrained(path, state_dict=plain_state_dict(model))
    else:
        model.save_pretrained(path)


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
