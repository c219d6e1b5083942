"""Tiny random-weight DiTs for parity tests: diffusers' reference and ours with the same weights."""

from __future__ import annotations

import torch
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

TINY_DIT = dict(
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    context_in_dim=48,
    axes_dims_rope=(8, 12, 12),
)
CHANNELS = TINY_DIT["in_channels"]
CONTEXT = TINY_DIT["context_in_dim"]


def reference_dit(seed: int = 0):
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(**TINY_DIT).eval()
    with torch.no_grad():  # make every norm weight non-trivial, so a misplaced weight shows up
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(0, 0.1)
                if "norm_q" in name or "norm_k" in name:
                    param.add_(1.0)
    return model


def our_dit(reference) -> QwenImage21Transformer:
    model = QwenImage21Transformer(TransformerConfig(**TINY_DIT)).eval()
    model.load_diffusers_state_dict(reference.state_dict())
    return model


def prompt_mask(text_before: int, condition_shapes, text_between: int = 3, text_after: int = 5) -> torch.Tensor:
    """[L] bool prompt with image slots: text, then per image its slots and some text, then text."""
    parts = [torch.zeros(text_before, dtype=torch.bool)]
    for h, w in condition_shapes:
        parts += [torch.ones(h * w // 4, dtype=torch.bool), torch.zeros(text_between, dtype=torch.bool)]
    parts.append(torch.zeros(text_after, dtype=torch.bool))
    return torch.cat(parts)


def reference_velocity(reference, prompt_embeds, image_pad_mask, condition_tokens, condition_shapes, x, t, **kw):
    """The target rows of the reference's full (uncached) forward. x: [B, N, C]; condition_tokens [I, C]."""
    batch, tokens, _ = x.shape
    th, tw = kw.pop("target_shape")
    img_mask = torch.cat([image_pad_mask, torch.ones(th * tw // 4, dtype=torch.bool)])[None].expand(batch, -1)
    img_mask = img_mask.to(x.device)
    shapes = [[(1, h, w) for h, w in condition_shapes] + [(1, th, tw)]] * batch
    hidden = x if condition_tokens is None else torch.cat([condition_tokens[None].expand(batch, -1, -1), x], 1)
    with torch.no_grad():
        out = reference(
            hidden_states=hidden,
            encoder_hidden_states=prompt_embeds[None].expand(batch, -1, -1),
            timestep=t,
            img_shapes=shapes,
            img_mask=img_mask,
            return_dict=False,
            **kw,
        )[0]
    return out[:, -tokens:]


TINY_LATENT = 16


def tiny_reference_vae(seed: int = 0, z_dim: int = TINY_LATENT):
    """A small diffusers VAE with non-trivial latents_mean/std (so normalisation mistakes show up)."""
    from diffusers import AutoencoderKLQwenImage21

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=12, z_dim=z_dim, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True, True], latents_mean=torch.randn(z_dim, generator=g).tolist(),
        latents_std=(torch.rand(z_dim, generator=g) + 0.5).tolist(), in_channels=4, out_channels=4,
    ).eval()  # fmt: skip


QWEN21_SCHEDULER_KW = dict(
    use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
    shift_terminal=0.02,
)  # fmt: skip


def reference_pipeline(transformer, vae, sample_sigmas=None):
    """diffusers' QwenImage21Pipeline around the given parts, without a text encoder (tests feed embeddings)."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from diffusers.image_processor import VaeImageProcessor

    pipe = QwenImage21Pipeline.__new__(QwenImage21Pipeline)
    DiffusionPipeline.__init__(pipe)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN21_SCHEDULER_KW)
    pipe.register_modules(vae=vae, text_encoder=None, processor=None, transformer=transformer, scheduler=scheduler)
    pipe.register_to_config(sample_sigmas=sample_sigmas)
    pipe.vae_scale_factor = 16
    pipe.latent_channels = vae.config.z_dim
    pipe.image_processor = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=vae.config.z_dim)
    return pipe
