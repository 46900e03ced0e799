"""Real models for the tests and the model benchmark: Hugging Face models built from small
configs (random weights, no downloads), and torchvision and timm models where installed.

A :class:`RealModel` names a model, its family (``causal``: a causal LM called with padded
ids and ``labels``; ``encoder``: ids and a padding mask; ``seq2seq``: encoder ids, mask and
decoder ids; ``vision``: images) and how to build it at a size: ``tiny`` for the CPU tests
(hidden 64, 2 layers, 4 heads, vocabulary 256; images 32x32), ``small`` for the GPU benchmark
(hidden 256, 4 layers, batch 8 x 128 tokens; images 8 x 224x224, as ``shared/MEASURED.md``'s
table). ``transformers``, ``torchvision`` and ``timm`` are optional: a registry entry whose
library is missing says so (:func:`available`).

Inputs have padding: the first sequence's last third is masked, so kernels see a real mask,
and lengths are whatever the caller asks (odd ones included).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MODELS", "RealModel", "available", "fixed_step", "flat_tensors", "inputs_for",
           "loss_of", "without_dropout"]

SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, ffn=128, vocab=256, image=32, patch=8),
    "small": dict(hidden=256, layers=4, heads=4, ffn=1024, vocab=1024, image=224, patch=16),
}


@dataclass(frozen=True)
class RealModel:
    name: str
    family: str  # causal, encoder, seq2seq, vision
    library: str  # transformers, torchvision, timm
    build: Callable[[dict], torch.nn.Module]  # SIZES entry -> the model, in eval mode

    def make(self, size: str = "tiny", seed: int = 0, layers: int | None = None) -> torch.nn.Module:
        """The model at ``size`` (``layers``: that many blocks in place of the size's, for
        tests whose point one block makes; Hugging Face models only, the others have theirs),
        its weights drawn from ``seed``, in eval mode."""
        torch.manual_seed(seed)
        return self.build(SIZES[size] | ({} if layers is None else {"layers": layers})).eval()


def available(m: RealModel) -> str | None:
    """Why ``m`` can't be built here (its library is missing), or None."""
    if importlib.util.find_spec(m.library) is None:
        return f"{m.library} is not installed"
    return None


def _hf(config: str, model: str, **fields: Any) -> Callable[[dict], torch.nn.Module]:
    def build(s: dict) -> torch.nn.Module:
        import transformers as T  # optional dependency

        values = {k: (s[v[1:]] if isinstance(v, str) and v.startswith("$") else v)
                  for k, v in fields.items()}
        return getattr(T, model)(getattr(T, config)(**values))
    return build


_TEXT = dict(hidden_size="$hidden", num_hidden_layers="$layers", num_attention_heads="$heads",
             intermediate_size="$ffn", vocab_size="$vocab", max_position_embeddings=512)
_VISION = dict(hidden_size="$hidden", num_hidden_layers="$layers",
               num_attention_heads="$heads", intermediate_size="$ffn", image_size="$image",
               patch_size="$patch")


def _torchvision(name: str) -> Callable[[dict], torch.nn.Module]:
    def build(s: dict) -> torch.nn.Module:
        import torchvision  # optional dependency

        return getattr(torchvision.models, name)(weights=None)
    return build


def _timm(name: str) -> Callable[[dict], torch.nn.Module]:
    def build(s: dict) -> torch.nn.Module:
        import timm  # optional dependency

        return timm.create_model(name, pretrained=False)
    return build


MODELS: dict[str, RealModel] = {m.name: m for m in [
    RealModel("gpt2", "causal", "transformers", _hf(
        "GPT2Config", "GPT2LMHeadModel", n_embd="$hidden", n_layer="$layers",
        n_head="$heads", vocab_size="$vocab", n_positions=512, bos_token_id=0,
        eos_token_id=0)),
    RealModel("llama", "causal", "transformers", _hf(
        "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_TEXT)),
    RealModel("mistral", "causal", "transformers", _hf(
        "MistralConfig", "MistralForCausalLM", num_key_value_heads=2, **_TEXT)),
    RealModel("qwen2", "causal", "transformers", _hf(
        "Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_TEXT)),
    RealModel("opt", "causal", "transformers", _hf(
        "OPTConfig", "OPTForCausalLM", hidden_size="$hidden", num_hidden_layers="$layers",
        num_attention_heads="$heads", ffn_dim="$ffn", vocab_size="$vocab",
        word_embed_proj_dim="$hidden", max_position_embeddings=512)),
    RealModel("bloom", "causal", "transformers", _hf(
        "BloomConfig", "BloomForCausalLM", hidden_size="$hidden", n_layer="$layers",
        n_head="$heads", vocab_size="$vocab")),
    RealModel("phi", "causal", "transformers", _hf("PhiConfig", "PhiForCausalLM", **_TEXT)),
    RealModel("bert", "encoder", "transformers", _hf("BertConfig", "BertModel", **_TEXT)),
    RealModel("roberta", "encoder", "transformers", _hf(
        "RobertaConfig", "RobertaModel", pad_token_id=1, **_TEXT)),
    RealModel("distilbert", "encoder", "transformers", _hf(
        "DistilBertConfig", "DistilBertModel", dim="$hidden", n_layers="$layers",
        n_heads="$heads", hidden_dim="$ffn", vocab_size="$vocab")),
    RealModel("albert", "encoder", "transformers", _hf(
        "AlbertConfig", "AlbertModel", embedding_size="$hidden", **_TEXT)),
    RealModel("electra", "encoder", "transformers", _hf(
        "ElectraConfig", "ElectraModel", embedding_size="$hidden", **_TEXT)),
    RealModel("deberta-v2", "encoder", "transformers", _hf(
        "DebertaV2Config", "DebertaV2Model", **_TEXT)),
    RealModel("t5", "seq2seq", "transformers", _hf(
        "T5Config", "T5ForConditionalGeneration", d_model="$hidden", d_ff="$ffn",
        num_layers="$layers", num_heads="$heads", d_kv=16, vocab_size="$vocab")),
    RealModel("vit", "vision", "transformers", _hf("ViTConfig", "ViTModel", **_VISION)),
    RealModel("convnext", "vision", "transformers", _hf(
        "ConvNextConfig", "ConvNextModel", hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1])),
    RealModel("hf-resnet", "vision", "transformers", _hf(
        "ResNetConfig", "ResNetModel", embedding_size=16, hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1])),
    RealModel("swin", "vision", "transformers", _hf(
        "SwinConfig", "SwinModel", image_size="$image", patch_size=4, embed_dim=16,
        depths=[1, 1], num_heads=[2, 2], window_size=4)),
    RealModel("resnet18", "vision", "torchvision", _torchvision("resnet18")),
    RealModel("resnet50", "vision", "torchvision", _torchvision("resnet50")),
    RealModel("mobilenet_v3", "vision", "torchvision", _torchvision("mobilenet_v3_large")),
    RealModel("efficientnet_b0", "vision", "torchvision", _torchvision("efficientnet_b0")),
    RealModel("timm-vit-tiny", "vision", "timm", _timm("vit_tiny_patch16_224")),
    RealModel("timm-convnext-atto", "vision", "timm", _timm("convnext_atto")),
]}


def inputs_for(m: RealModel, size: str = "tiny", batch: int = 3, length: int = 11,
               device: str = "cpu", seed: int = 1) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one call of ``m``: ids with a padding mask (the first sequence's
    last third masked) for text, images for vision; ``labels`` for a causal LM."""
    s = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    if m.family == "vision":
        side = s["image"] if m.library == "transformers" else max(s["image"], 64)
        images = torch.randn(batch, 3, side, side, generator=g).to(device)
        return ((images,), {}) if m.library != "transformers" else ((), {"pixel_values": images})
    ids = torch.randint(3, s["vocab"], (batch, length), generator=g).to(device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[0, length - length // 3:] = 0
    if m.family == "causal":
        return (), {"input_ids": ids, "attention_mask": mask, "labels": ids}
    if m.family == "seq2seq":
        return (), {"input_ids": ids, "attention_mask": mask,
                    "decoder_input_ids": ids[:, : max(1, length // 2)]}
    return (), {"input_ids": ids, "attention_mask": mask}


def flat_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, in order (ModelOutput fields, tuples, lists)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, tuple | list):
        return [t for x in out for t in flat_tensors(x)]
    return []


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every dropout off, in place: ``nn.Dropout`` modules and the float rates
    that functional dropout reads (T5's attention: ``self.dropout = config.dropout_rate``,
    passed to ``F.dropout`` in training). Random draws differ between ways (as under
    ``torch.compile``): equality is checked where a step is deterministic."""
    for sub in model.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
        for key, value in list(vars(sub).items()):
            if isinstance(value, float) and "drop" in key:
                setattr(sub, key, 0.0)
    return model


def loss_of(out: Any) -> torch.Tensor:
    """A scalar to train on: the model's own loss where it gives one, else the sum of its
    floating outputs' mean squares (every output, so that every parameter gets a gradient:
    where an output is left out, eager leaves its parameters' ``.grad`` None, and a graph
    compiled by aot_autograd, ``torch.compile``'s too, gives them zeros). 16-bit outputs are
    summed in float32, float64 ones in float64."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    return sum((t if t.element_size() >= 4 else t.float()).pow(2).mean()
               for t in flat_tensors(out) if t.is_floating_point())


def _stepped(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float | None,
             args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """One step: ``zero_grad``, the loss of ``model(*args, **kwargs)``, ``backward``,
    ``clip_grad_norm_`` (unless ``clip`` is None), ``opt.step()``; the loss, detached."""
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


def fixed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, args: Sequence[Any],
               kwargs: dict[str, Any], clip: float | None = None) -> Callable[[], torch.Tensor]:
    """A training step over fixed inputs, as the benchmarks time it: ``step()`` is
    :func:`_stepped` on ``model(*args, **kwargs)``."""
    def step() -> torch.Tensor:
        return _stepped(model, opt, clip, args, kwargs)
    return step


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, keys: Sequence[str],
               clip: float | None = 1.0) -> Callable[..., torch.Tensor]:
    """A training step as users write it: ``step(*batch)`` calls ``model(**dict(zip(keys,
    batch)))``, then ``zero_grad``, :func:`loss_of`, ``backward``, ``clip_grad_norm_`` (unless
    ``clip`` is None) and ``opt.step()``; returns the loss, detached."""
    def step(*batch: torch.Tensor) -> torch.Tensor:
        return _stepped(model, opt, clip, (), dict(zip(keys, batch)))
    return step
