"""Write the launch-configuration table of this GPU's architecture (kernels/tuned/sm_XY.json, see
kernels/launch_configs.py): every candidate of every key the Qwen-Image-2.1 DiT meets, timed, the fastest kept.

    python benchmarks/tune_kernels.py                       # tune on this GPU; the table goes to kernels/tuned/
    python benchmarks/tune_kernels.py --out DIR --threads 12
    python benchmarks/tune_kernels.py --list                # the keys and candidate counts only (no GPU needed)

Keys: the int8 GEMM for the block's four projections (QKV 4096->12288, out 4096->4096 with the gated residual,
gate_up 4096->24576, down 12288->4096 with the residual) and the row quantiser for their inputs (modulated LayerNorm,
plain, SwiGLU; fp8, int8 and int8 with ConvRot), each at every M bucket from 16 to 16384 rows. Candidates compile in
parallel threads first (Triton's compiler releases the GIL for most of its work), then each is timed alone
(triton.testing.do_bench, median). One JSON line per key: the chosen configuration, its time, the rule's time and
their ratio; a last line with the totals.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import torch
from _common import emit
from qwen21_nodes.kernels import int8_gemm, launch_configs, quantize_rows
from qwen21_nodes.kernels.launch_configs import all_buckets, key_text
from qwen21_nodes.qwen21_core.config import TransformerConfig

# quantize_rows' pre-ops (its _PRE_* values) and the projections whose input each produces
PRE_LAYER_NORM, PRE_NONE, PRE_SWIGLU = 1, 0, 2


def gemm_shapes(config: TransformerConfig) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, gated residual) of the block's projections."""
    d, m = config.inner_dim, config.mlp_dim
    return [("qkv", 3 * d, d, False), ("out", d, d, True), ("gate_up", 2 * m, d, False), ("down", d, m, True)]


def quantizer_modes(config: TransformerConfig) -> list[tuple[str, int, int, bool, bool]]:
    """(name, K, pre-op, ConvRot, int8 out) of every activation quantisation a quantised block runs."""
    d, m = config.inner_dim, config.mlp_dim
    modes = []
    for fmt, rotate, out_int8 in (("fp8", False, False), ("int8", False, True), ("int8_convrot", True, True)):
        for what, k, pre in (("ln", d, PRE_LAYER_NORM), ("plain", d, PRE_NONE), ("swiglu", m, PRE_SWIGLU)):
            modes.append((f"{fmt}:{what}", k, pre, rotate, out_int8))
    return modes


def gemm_keys(config):
    for name, n, k, residual in gemm_shapes(config):
        for bucket in all_buckets():
            yield name, {"M_BUCKET": bucket, "N": n, "K": k, "RESIDUAL": residual}


def quantizer_keys(config):
    for name, k, pre, rotate, out_int8 in quantizer_modes(config):
        for bucket in all_buckets():
            yield name, {"K": k, "M_BUCKET": bucket, "PRE": pre, "DEQUANT": False, "ROTATE": rotate,
                         "OUT_INT8": out_int8}  # fmt: skip


# ---- inputs and launches -------------------------------------------------------------------------------


def gemm_problem(key, device):
    m, n, k = key["M_BUCKET"], key["N"], key["K"]
    q = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
    scale, w_scale = torch.rand(m, device=device) / 127, torch.rand(n, device=device) / 127
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    residual = torch.randn(m, n, device=device, dtype=torch.bfloat16) if key["RESIDUAL"] else None
    gate = torch.randn(1, n, device=device, dtype=torch.bfloat16) if key["RESIDUAL"] else None
    args = (q, w, scale, w_scale, out if residual is None else residual, out if gate is None else gate, out, m, n, k,
            m, q.stride(0), w.stride(0), 0 if residual is None else residual.stride(0),
            0 if gate is None else gate.stride(0), m, out.stride(0))  # fmt: skip
    constexprs = {"RESIDUAL": bool(key["RESIDUAL"]), "OUT_DTYPE": int8_gemm.TL_DTYPES[torch.bfloat16]}
    return int8_gemm._int8_gemm_kernel, lambda config: int8_gemm._grid(m, n, config), args, constexprs


def quantizer_problem(key, device):
    m, k = key["M_BUCKET"], key["K"]
    width = 2 * k if key["PRE"] == PRE_SWIGLU else k
    x = torch.randn(m, width, device=device, dtype=torch.bfloat16)
    mod = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    q = torch.empty(m, k, device=device, dtype=torch.int8 if key["OUT_INT8"] else torch.float8_e4m3fn)
    scale = torch.empty(m, device=device)
    group = quantize_rows.ROTATION_GROUP  # the official int8_convrot files' ConvRot group
    rot_a, ha, rot_b, hb = quantize_rows._rotation_factors(group, device) if key["ROTATE"] else (1, scale, 16, scale)
    args = (x, x.stride(0), scale, scale, mod, mod.stride(0), m, ha, hb, q, q.stride(0), scale, m, k, m, 1.0 / k, 1e-6)
    fmt = "int8" if key["OUT_INT8"] else "fp8"
    constexprs = dict(PRE=key["PRE"], DEQUANT=False, ROTATE=bool(key["ROTATE"]), ROT_A=rot_a, ROT_B=rot_b,
                      OUT_INT8=bool(key["OUT_INT8"]),
                      QMAX=quantize_rows.QMAX[fmt], MIN_SCALE=quantize_rows.MIN_SCALE,
                      ACT_DTYPE=quantize_rows.TL_DTYPES[torch.bfloat16], BLOCK_K=quantize_rows._block_k(key),
                      WHOLE_ROW=True)  # fmt: skip
    grid = lambda config: (quantize_rows.cdiv(m, config.meta_dict()["BLOCK_M"]),)  # noqa: E731
    return quantize_rows._quantize_rows_kernel, grid, args, constexprs


KERNELS = {
    "int8_gemm": (int8_gemm.TUNED, gemm_keys, gemm_problem),
    "quantize_rows": (quantize_rows.TUNED, quantizer_keys, quantizer_problem),
}


def compile_all(jobs, threads: int) -> dict:
    """Compile (Triton's warmup: no launch) every distinct variant among the (kernel, key, config) jobs in parallel
    threads; -> failures by job index. Jobs differing only in row counts share a variant (rows are not
    specialised on), so only one of them compiles it."""
    variants: dict[tuple, list[int]] = {}
    for index, (fn, _grid, args, constexprs, config) in enumerate(jobs):
        variants.setdefault((id(fn), config, tuple(sorted(constexprs.items())), len(args)), []).append(index)
    failures = {}

    def compile_one(indices):
        fn, grid, args, constexprs, config = jobs[indices[0]]
        try:
            fn.warmup(*args, grid=grid(config), **constexprs, **config.as_dict())
        except Exception as error:  # noqa: BLE001 - a candidate that does not compile here is skipped
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            failures.update(dict.fromkeys(indices, reason))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(compile_one, variants.values()))
    return failures


def time_config(fn, grid, args, constexprs, config) -> float:
    import triton.testing

    return triton.testing.do_bench(lambda: fn[grid(config)](*args, **constexprs, **config.as_dict()),
                                   warmup=5, rep=20, return_mode="median")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=launch_configs.TABLE_DIR, help="folder for sm_XY.json")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: " + ", ".join(KERNELS))
    parser.add_argument("--threads", type=int, default=12, help="parallel compile threads")
    parser.add_argument("--list", action="store_true", help="print the keys and candidate counts, tune nothing")
    args = parser.parse_args()
    config = TransformerConfig()
    names = [name for name in args.kernels.split(",") if name]
    if args.list:
        for name in names:
            tuned, keys, _ = KERNELS[name]
            for label, key in keys(config):
                emit(what="tune_key", kernel=name, shape=label, key=key_text(key),
                     candidates=len(tuned.candidates(key)), rule=str(tuned.rule(key)))  # fmt: skip
        return
    device = torch.device("cuda")
    arch = launch_configs.architecture(device)
    table = {"arch": arch, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
             "triton": launch_configs.triton.__version__, "tuned": date.today().isoformat(), "kernels": {}}  # fmt: skip
    started = time.perf_counter()
    totals = {"keys": 0, "compiled": 0, "compile_failures": 0}
    for name in names:
        tuned, keys, problem = KERNELS[name]
        problems = [(label, key, *problem(key, device)) for label, key in keys(config)]
        jobs, owners = [], []
        for index, (_label, key, fn, grid, call_args, constexprs) in enumerate(problems):
            for candidate in dict.fromkeys([tuned.rule(key), *tuned.candidates(key)]):
                jobs.append((fn, grid, call_args, constexprs, candidate))
                owners.append(index)
        compile_started = time.perf_counter()
        failures = compile_all(jobs, args.threads)
        emit(what="tune_compile", kernel=name, jobs=len(jobs), failures=len(failures),
             seconds=round(time.perf_counter() - compile_started, 1))  # fmt: skip
        totals["compiled"] += len(jobs)
        totals["compile_failures"] += len(failures)
        entries = {}
        for index, (label, key, fn, grid, call_args, constexprs) in enumerate(problems):
            times = {}
            for job_index, owner in enumerate(owners):
                if owner != index or job_index in failures:
                    continue
                candidate = jobs[job_index][4]
                times[candidate] = time_config(fn, grid, call_args, constexprs, candidate)
            if not times:
                emit(what="tune_key", kernel=name, shape=label, key=key_text(key), error="no candidate compiled")
                continue
            best = min(times, key=times.get)
            rule = tuned.rule(key)
            rule_ms = times.get(rule, float("nan"))
            entries[key_text(key)] = best.as_dict()
            emit(what="tune_key", kernel=name, shape=label, key=key_text(key), best=str(best),
                 best_ms=round(times[best], 4), rule=str(rule), rule_ms=round(rule_ms, 4),
                 rule_over_best=round(rule_ms / times[best], 3), candidates=len(times))  # fmt: skip
            totals["keys"] += 1
        table["kernels"][name] = entries
        del problems
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{arch}.json"
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    emit(what="tune_done", arch=arch, table=str(path), seconds=round(time.perf_counter() - started, 1), **totals)


if __name__ == "__main__":
    main()
