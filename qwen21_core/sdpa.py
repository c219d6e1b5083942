"""Attention kernels that cost nothing extra at a shape met for the first time.

Every changed prompt has a new length, so the text encoder, the DiT's prefill and the first decode step of each
changed prompt call attention at shapes never seen before. Torch's SDPA prefers cuDNN's kernel on Hopper, and cuDNN
builds an execution plan on the host for every new shape: its first call at a new length took hundreds of times as
long as the flash kernel's, which was also faster at a repeated short length (benchmarks/bench_attention_lengths.py
measures both). So where the shapes follow the prompt's length (the text
encoder, the DiT's prefill) we choose among the kernels that plan nothing: flash, then the memory-efficient kernel
(masks), then the math fallback. Where a shape repeats every step (the decode step's image tokens) cuDNN's plan is
paid once per size and its kernel was faster there: dit/attention.py keeps it.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

PRIMING_HEAD_DIM = 128  # the text encoder's and the DiT's head size


def planless_kernels():
    """A context in which SDPA picks from flash, memory-efficient and math only (not cuDNN). The flags it sets only
    matter on CUDA; on the CPU torch's own kernels run either way."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@torch.no_grad()
def prime_flash_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
    """Launch the flash kernel variants the encoder (causal) and the prefill (not causal) pick, at a length that fills
    its tiles and one that does not (the kernel is specialised on both), so that CUDA has loaded them before a
    prompt (qwen21_core/startup/priming.py). The aten op is called directly: `planless_kernels` sets SDPA's backend
    flags for the whole process, and another thread's attention must not change kernel meanwhile."""
    if torch.cuda.get_device_capability(device) < (8, 0):
        return  # no flash kernel before Ampere: SDPA picks the memory-efficient or the math kernel there
    for length in (77, 128):
        q = torch.zeros(1, 2, length, PRIMING_HEAD_DIM, device=device, dtype=dtype)
        for causal in (True, False):
            torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, causal)
