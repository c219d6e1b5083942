"""Where does our exact VAE decode first differ from diffusers'? Runs both decoders on the same random full-size
weights and latents, compares the output of every residual block, attention and up block, and for the first
block that differs, its norm and conv outputs computed from the reference's own block input. Prints JSON lines.

    python benchmarks/check_vae_identity.py --sizes 1024 2048        # bf16 on CUDA
    python benchmarks/check_vae_identity.py --tiny --device cpu --dtype fp32
"""

from __future__ import annotations

import argparse

import torch
from _common import emit
from bench_vae import TINY_CONFIG, build_models
from qwen21_nodes.kernels import rmsnorm_silu as norm_kernel
from qwen21_nodes.qwen21_core.config import VAEConfig
from qwen21_nodes.qwen21_core.vae.model import ExactOps, ResidualBlock
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _frame(t):
    return t[:, :, 0] if t.dim() == 5 else t


def _compare(name, ours, ref, **fields):
    ref = _frame(ref)
    same = ours.shape == ref.shape and torch.equal(ours, ref)
    diff = (ours.float() - ref.float()).abs()
    emit(what="module", name=name, identical=same, max_abs=diff.max().item(),
         differing=(diff > 0).float().mean().item(), ours_stride=list(ours.stride()), ref_stride=list(ref.stride()),
         **fields)  # fmt: skip
    return same


def block_outputs(decoder, names):
    """Hooks recording (input, output) of the named submodules of `decoder`."""
    records, handles = {}, []
    modules = dict(decoder.named_modules())
    for name in names:

        def hook(module, args, output, name=name):
            records[name] = (_frame(args[0]), _frame(output))

        handles.append(modules[name].register_forward_hook(hook))
    return records, handles


def drill_into(name, ours_block, ref_block, block_input, ops):
    """Our norm1/conv1/norm2 of a residual block on the reference's input, against its submodules."""
    sub = {}
    handles = [
        getattr(ref_block, part).register_forward_hook(lambda m, a, o, part=part: sub.__setitem__(part, _frame(o)))
        for part in ("norm1", "conv1", "norm2", "conv2")
    ]
    with torch.no_grad():
        ref_block(block_input[:, :, None])
    for h in handles:
        h.remove()
    x = block_input
    norm1 = ops.norm(x, ours_block.norm1, silu=False)
    _compare(f"{name}.norm1", norm1, sub["norm1"], input_stride=list(x.stride()))
    conv1 = ops.norm_conv(x, ours_block.norm1, True, ours_block.conv1, (1, 1, 1, 1))
    _compare(f"{name}.conv1", conv1, sub["conv1"])
    conv1_from_ref = ops.conv(torch.nn.functional.silu(_frame(sub["norm1"])), ours_block.conv1, (1, 1, 1, 1))
    _compare(f"{name}.conv1_on_ref_norm", conv1_from_ref, sub["conv1"])
    norm2 = ops.norm(_frame(sub["conv1"]), ours_block.norm2, silu=False)
    _compare(f"{name}.norm2_on_ref_conv1", norm2, sub["norm2"], input_stride=list(_frame(sub["conv1"]).stride()))


def check(config, device, dtype, res):
    ref, ours = build_models(config, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(res)
    z = torch.randn(1, config.z_dim, res // 16, res // 16, generator=gen).to(device, dtype)
    names = [n for n, m in ours.decoder.named_modules() if n and n.count(".") <= 3 and not isinstance(m, nn.ModuleList)]
    ref_records, ref_handles = block_outputs(ref.decoder, names)
    our_records, our_handles = block_outputs(ours.decoder, names)
    with torch.no_grad():
        want = _frame(ref.decode(z[:, :, None]).sample)
        got = ours.decode_pixels(z)
    for h in ref_handles + our_handles:
        h.remove()
    emit(what="output", res=res, identical=torch.equal(got, want), max_abs=(got - want).abs().max().item())
    modules = dict(ours.decoder.named_modules())
    ref_modules = dict(ref.decoder.named_modules())
    for name in ref_records:  # the order the blocks finished in
        if name not in our_records:
            continue
        if not _compare(name, our_records[name][1], ref_records[name][1], res=res):
            if isinstance(modules[name], ResidualBlock):
                drill_into(name, modules[name], ref_modules[name], ref_records[name][0], ExactOps())
            break


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--copy-norm", action="store_true", help="half-precision norms over an fp32 copy only")
    args = parser.parse_args()
    config = TINY_CONFIG if args.tiny else VAEConfig()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    for res in args.sizes:
        if args.copy_norm:
            with norm_kernel.SELF_TESTS.forced("direct_norm", device, dtype, False):
                check(config, device, dtype, res)
        else:
            check(config, device, dtype, res)


if __name__ == "__main__":
    main()
