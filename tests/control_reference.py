"""Tiny random-weight DiTs with a Fun-Control branch, for parity tests: DiffSynth-Studio's Qwen-Image-2.1 DiT and
ControlNet (diffsynth 2.1.12, a test dependency: an implementation that is not ours) and ours, holding the same
weights. Its forward recomputes the whole sequence at every call, without a cache."""

from __future__ import annotations

import torch
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.control import CONTROL_CHANNELS, FunControlNet, injection_layers
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

CONTROL_DIT = dict(
    in_channels=16,
    out_channels=16,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=2,
    context_in_dim=48,
    axes_dims_rope=(8, 12, 12),
)
CONTROL_BLOCKS = 2
CHANNELS = CONTROL_DIT["in_channels"]
CONTEXT = CONTROL_DIT["context_in_dim"]


def _nontrivial_(model: torch.nn.Module, seed: int) -> None:
    """Every weight random and every norm weight off its default, so a misplaced weight shows up."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.1 if param.ndim == 1 else 0.05))
            if "norm_q" in name or "norm_k" in name:
                param.add_(1.0)


def reference_models(seed: int = 0):
    """(diffsynth DiT, diffsynth ControlNet) with random weights."""
    from diffsynth.models.qwen_image_21_controlnet import QwenImage21ControlNet
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT

    dit = QwenImage21DiT(**CONTROL_DIT).eval()
    _nontrivial_(dit, seed)
    config = TransformerConfig(**CONTROL_DIT)
    controlnet = QwenImage21ControlNet(
        control_layers=injection_layers(config.num_layers, CONTROL_BLOCKS), control_in_dim=CONTROL_CHANNELS,
        dim=config.inner_dim, num_attention_heads=config.num_attention_heads,
        attention_head_dim=config.attention_head_dim, mlp_ratio=config.mlp_ratio, eps=config.eps,
    ).eval()  # fmt: skip
    _nontrivial_(controlnet, seed + 1)
    return dit, controlnet


def our_models(reference_dit, reference_controlnet) -> tuple[QwenImage21Transformer, FunControlNet]:
    config = TransformerConfig(**CONTROL_DIT)
    dit = QwenImage21Transformer(config).eval()
    dit.load_diffusers_state_dict(reference_dit.state_dict())
    net = FunControlNet(config, CONTROL_BLOCKS).eval()
    slots = net.checkpoint_slots()
    state = reference_controlnet.state_dict()
    assert set(slots) == set(state), set(slots) ^ set(state)
    with torch.no_grad():
        for key, slot in slots.items():
            slot.copy_(state[key])
    return dit, net


def reference_velocity(dit, controlnet, prompt_embeds, image_pad_mask, condition_tokens, condition_shapes, x, t,
                       target_shape, context=None, scale=1.0):  # fmt: skip
    """The target rows of diffsynth's full forward. x: [B, N, C]; context: [N, 129] control tokens or None."""
    batch, tokens, _ = x.shape
    th, tw = target_shape
    img_mask = torch.cat([image_pad_mask, torch.ones(th * tw // 4, dtype=torch.bool)])[None].expand(batch, -1)
    shapes = [[(1, h, w) for h, w in condition_shapes] + [(1, th, tw)]] * batch
    hidden = x if condition_tokens is None else torch.cat([condition_tokens[None].expand(batch, -1, -1), x], 1)
    kwargs = {}
    if context is not None:
        kwargs = dict(controlnet=controlnet, control_context=context[None].expand(batch, -1, -1), control_scale=scale)
    with torch.no_grad():
        out = dit(hidden_states=hidden, encoder_hidden_states=prompt_embeds[None].expand(batch, -1, -1), timestep=t,
                  img_shapes=shapes, img_mask=img_mask, **kwargs)  # fmt: skip
    return out[:, -tokens:]
