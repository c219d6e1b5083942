"""The benchmark scripts' own logic on the CPU with tiny models (their numbers come from the H200)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_VAE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vae.py"
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
needs_comfyui_server = pytest.mark.skipif(
    not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").is_file(),
    reason="set COMFYUI_DIR to a ComfyUI checkout (with main.py) to run the session through a ComfyUI server",
)


def _run(*args, interpreter=False):
    command = [sys.executable, str(BENCH_VAE), "--tiny", "--device", "cpu", "--iters", "1", *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRITON_INTERPRET="1" if interpreter else "0")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=BENCH_VAE.parents[1])
    assert done.returncode == 0, done.stderr
    by_what = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            by_what.setdefault(record["what"], []).append(record)
    return by_what


@pytest.mark.slow
def test_bench_vae_placeholders_flag_compares_cudnn_benchmark_mode_in_fresh_processes():
    """--placeholders, part 1: the fast decode with cuDNN benchmark mode on and off, each in its own process,
    first call and steady state, and the break-even count. (Part 2, the kernel sweep, needs Triton on a GPU or
    the interpreter: without either it says it was skipped.)"""
    by_what = _run("--placeholders", "--sizes", "32")
    settings = {r["cudnn_benchmark"]: r for r in by_what["cudnn_benchmark"]}
    assert set(settings) == {True, False}
    for record in settings.values():
        assert record["res"] == 32 and record["first_call_ms"] > 0 and record["ms"] > 0 and record["psnr_vs_exact"] > 30
    (summary,) = by_what["cudnn_benchmark_summary"]
    assert summary["on_ms"] == settings[True]["ms"] and summary["off_first_call_ms"] == settings[False]["first_call_ms"]
    assert "break_even_decodes" in summary
    (skipped,) = by_what["norm_kernel_sweep_summary"]
    assert "cannot run on cpu" in skipped["skipped"]


@pytest.mark.slow
def test_bench_vae_kernel_sweep_times_both_kernels_at_the_decoders_shapes():
    """--sweep-kernel (part 2 of --placeholders) under the Triton interpreter, on a two-point grid."""
    pytest.importorskip("triton")
    by_what = _run("--sweep-kernel", "--sweep-size", "32", "--kernel-reps", "1", "--sweep-elements", "4096",
                   "--sweep-block-c", "8", "16", "--sweep-warps", "4", interpreter=True)  # fmt: skip
    calls = by_what["norm_kernel_calls"]
    for kernel, layout in (("eager", "torch.contiguous_format"), ("fused", "torch.channels_last")):
        mine = [r for r in calls if r["kernel"] == kernel]
        # one decode: 2 resnets x 2 norms + the attention norm in the mid block, 5 up blocks x 3 resnets x 2 norms,
        # the head's norm
        assert sum(r["calls"] for r in mine) == 36 and {r["layout"] for r in mine} == {layout}
        launches = [r for r in by_what["norm_kernel_launch"] if r["kernel"] == kernel]
        swept_shapes = {tuple(r["shape"]) for r in mine if r["swept"]}
        assert {tuple(r["shape"]) for r in launches} == swept_shapes and all(r["ms"] > 0 for r in launches)
    summaries = {r["kernel"]: r for r in by_what["norm_kernel_sweep_summary"]}
    assert summaries["eager"]["current"] == {"block_elements": 4096, "block_c": 16, "num_warps": 4}
    assert summaries["fused"]["current"] == {"block_elements": 4096, "block_c": 64, "num_warps": 4}
    for kernel in ("eager", "fused"):
        assert summaries[kernel]["best_total_ms"] <= summaries[kernel]["current_total_ms"]
    assert summaries["shared"]["BLOCK_ELEMENTS"] == 4096 and summaries["shared"]["NUM_WARPS"] == 4


@pytest.mark.slow
def test_bench_lora_runs_every_measurement_on_a_tiny_model(tmp_path):
    """bench_lora --tiny on the CPU: every line the H200 run prints, for bf16 and each quantised format, with the
    checks that hold on any device (the LoRA changes the velocity, removal is bit-exact, the latter from both
    sources), and nothing left in --dir."""
    script = BENCH_VAE.parent / "bench_lora.py"
    command = [sys.executable, str(script), "--tiny", "--device", "cpu", "--iters", "1", "--steps", "3",
               "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=script.parents[1],
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    by_what = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            by_what.setdefault(record["what"], []).append(record)
    (step,) = by_what["lora_decode_step"]
    assert step["lora_changes_velocity"] and step["bit_identical_after_remove"]
    assert {r["restore_from"] for r in by_what["lora_switch"]} == {"file", "memory"}
    formats = ["fp8", "int8", "int8_convrot"]
    for fmt in formats:
        layers = [r for r in by_what["lora_quant_layers"] if r["format"] == fmt]
        assert {(r["merged_from"], r["layer"]) for r in layers} == {
            (source, path) for source in ("loaded values", "file floats")
            for path in ("attn.to_qkv", "attn.to_out", "img_mlp.gate_up", "img_mlp.out")
        }  # fmt: skip
        for r in layers:  # the merge's rounding is the format's kind of error: within 2x of it, never zero
            assert 0 < r["requant_rel_error_mean"] < 2 * r["format_rel_error_mean"] and r["blocks"] == 2
        (quant_step,) = [r for r in by_what["lora_quant_step"] if r["format"] == fmt]
        assert quant_step["lora_changes_velocity"] and quant_step["bit_identical_after_remove"]
        assert {"merged_decode_eager_ms", "side_path_decode_eager_ms", "eager_ratio_merged_vs_none",
                "velocity_psnr_drop_db", "velocity_psnr_side_path_vs_bf16_merged_db"} <= set(quant_step)  # fmt: skip
        assert quant_step["velocity_psnr_side_path_vs_bf16_merged_db"] > 40  # the exact path follows bf16's merge
        (latents,) = [r for r in by_what["lora_quant_latents"] if r["format"] == fmt]
        assert latents["steps"] == 3 and latents["latents_psnr_merged_vs_bf16_merged_db"] > 30
        (file_merge,) = [r for r in by_what["lora_quant_file_merge"] if r["format"] == fmt]
        assert file_merge["bit_identical_after_remove"] and "velocity_psnr_drop_db" in file_merge
        switches = {r["restore_from"]: r for r in by_what["lora_quant_switch"] if r["format"] == fmt}
        assert set(switches) == {"file", "memory"} and all(r["bit_identical_after_remove"] for r in switches.values())
        assert switches["memory"]["original_copies_gib"] > 0 == switches["file"]["original_copies_gib"]
        for row in switches.values():  # where each step's time went
            steps = ("merge_phases", "switch_strength_phases", "switch_lora_phases", "remove_phases")
            assert all("restore_s" in row[step] for step in steps) and "read_lora_s" in row["switch_lora_phases"]
        # a bf16 file's floats are re-read and merged in one pass; copies of loaded values sit beside CPU weights
        assert "file_read_and_merge_s" in switches["file"]["switch_strength_phases"]
        assert switches["memory"]["merge_phases"]["originals_on"] == "pageable"
    assert [r["format"] for r in by_what["lora_targets"]] == formats
    assert all(r["met"]["removal_bit_exact"] for r in by_what["lora_targets"])
    assert list(tmp_path.iterdir()) == []  # the random checkpoint and LoRAs were cleaned up


FP32_ROUNDING_DB = 120  # PSNR above this: the same latents up to the last bits of fp32


@pytest.mark.slow
def test_bench_multigpu_runs_every_part_over_gloo_with_two_cpu_processes():
    """bench_multigpu's smoke mode: rank 0 and one CPU worker (gloo), the tiny DiT in fp32; each part prints its line.
    The two-rank latents equal the one-rank ones up to fp32 rounding (README: within 1e-5): a rank's GEMMs see half
    the rows, and a CPU BLAS may choose another kernel, with another summation order, for another row count (149.9 dB
    on a 2-core AVX-512/AMX host, bit-identical on others). A wrong shard, merge or K/V split costs far more than
    that (tens of dB)."""
    script = BENCH_VAE.parent / "bench_multigpu.py"
    command = [sys.executable, str(script), "--tiny", "--device", "cpu", "--world-size", "2", "--precisions", "bf16",
               "--cfgs", "4", "--faults", "error", "--steps", "2"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=script.parents[1])
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by_what = {}
    for record in lines:
        by_what.setdefault(record["what"], []).append(record)
    assert {r["mode"] for r in by_what["multigpu_sampling"]} == {"sequence", "cfg"}
    for record in by_what["multigpu_sampling"] + by_what["multigpu_kv_cache"]:
        assert record["psnr_vs_one_gpu"] > FP32_ROUNDING_DB and record["step_ms"] > 0
    (kv,) = by_what["multigpu_kv_cache"]
    assert kv["per_gpu_cache_ratio"] == 0.5 and len(kv["per_gpu_cache_mib"]) == 2
    (recovery,) = by_what["multigpu_recovery"]
    assert "rank 1 (cpu): RuntimeError: injected fault" in recovery["error"]
    assert recovery["next_run_psnr_vs_one_gpu"] > FP32_ROUNDING_DB
    encoder = {r["encoder"]: r for r in by_what["multigpu_text_encoder"]}
    assert set(encoder) == {"resident on GPU 1", "offloaded from GPU 0"}
    assert all(r["seed_rerun_s"] > 0 and r["changed_prompt_s"] > r["encode_s"] > 0 for r in encoder.values())


def _json_lines(stdout: str) -> dict[str, list[dict]]:
    by_what: dict[str, list[dict]] = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            by_what.setdefault(record["what"], []).append(record)
    return by_what


def _bench(script: str, *args: str, timeout: int = 900) -> dict[str, list[dict]]:
    path = BENCH_VAE.parent / script
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=path.parents[1], env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return _json_lines(done.stdout)


def test_bench_save_png_times_both_savers_on_the_same_pixels():
    lines = _bench("bench_save_png.py", "--sizes", "64", "--rounds", "1")["save_png"]
    cases = {(line["image"], line["channels"]) for line in lines}
    assert cases == {(kind, channels) for kind in ("noise", "textured") for channels in (3, 4)}
    for line in lines:
        assert line["same_pixels"] and line["comfyui_s"] > 0 and line["ours_s"] > 0 and line["ours_kib"] > 0
        ours, comfyui, rounding = line["ours_s"], line["comfyui_s"], 5e-5  # seconds are printed to 4 decimals
        assert (ours - rounding) / (comfyui + rounding) <= line["ratio"] <= (ours + rounding) / (comfyui - rounding)


@pytest.mark.slow
def test_bench_session_smoke_runs_a_whole_session_through_the_nodes(tmp_path):
    """bench_session --tiny on the CPU: two sessions in one child process, every prompt of the plan through the
    node classes (changed prompts at every shape, edits, the seed-only rerun, the LoRA on and re-weighted), each
    with its phases, and a summary whose fields the H200 run fills."""
    by_what = _bench("bench_session.py", "--tiny", "--device", "cpu", "--tail", "1", "--log-dir", str(tmp_path),
                     "--profile", "new-shapes")  # fmt: skip
    prompts, summaries = by_what["session_prompt"], by_what["session_summary"]
    assert [s["cap_gib"] for s in summaries] == [None, 24] and all(s["errors"] == 0 for s in summaries)
    assert summaries[0]["kernel_cache"] == "empty" and summaries[1]["kernel_cache"] == "warm"
    first = [p for p in prompts if p["cap_gib"] is None]
    assert len(first) == summaries[0]["prompts"] == 15
    assert {p["label"] for p in first} >= {"t2i_1024", "t2i_1344x768", "t2i_768x1344", "t2i_1536", "edit_1ref",
                                           "edit_4ref", "t2i_1024:lora"}  # fmt: skip
    rerun = [p for p in first if not p["changed_prompt"]]
    # the runner's output cache, as ComfyUI's: the loader runs once; the rerun reuses the encoder's output
    assert len(rerun) == 1 and "Qwen21Encode" in rerun[0]["cached"] and "encode_s" not in rerun[0]
    assert "loader_s" in first[0] and all("Qwen21ModelLoader" in p["cached"] for p in first[1:])
    lora = [p for p in first if p["lora_strength"] is not None]
    assert all("Qwen21LoraLoader" not in p["cached"] for p in lora)  # on, then its strength changed: both run
    assert all(p["total_s"] >= p["sample_s"] + p["decode_s"] for p in first)
    assert [p["lora_strength"] for p in first if p["lora_strength"] is not None] == [1.0, 0.6]
    for summary in summaries:
        assert summary["first_image_s"] > 0 and summary["steady_image_s"] > 0 and summary["changed_prompt_ratio"] >= 1
    # the session's edits come back with the same reference images: prepared once, then found in the cache
    first_summary = summaries[0]["reference_cache"]
    assert first_summary["misses"] >= 1 and first_summary["hits"] >= 1
    # kept pinned K/V buffers: reported (on the CPU no cache is host-placed, so none is reused or kept)
    assert all(s["host_kv_buffers"] == {"reused": 0, "kept_gib": 0.0} for s in summaries)
    # --profile new-shapes: the host's time over each session's first prompt of every shape but the session's first
    profiles = by_what["session_profile"]
    assert [p["cap_gib"] for p in profiles] == [None, 24]
    assert profiles[0]["prompts"] == sum(p["first_of_shape"] for p in first) - 1
    functions = [row[-1] for row in profiles[0]["per_prompt_cumulative_own_calls"]]
    assert any(name.endswith(":execute") for name in functions)  # the runner's whole prompt is inside the profile
    assert (tmp_path / "session_fp8_None.pstats").is_file() and (tmp_path / "session_fp8_24.pstats").is_file()


def test_bench_session_small_runs_changed_512_prompts_and_reports_the_decode_graph():
    """--small N: N changed prompts at 512^2 (tiny: 64^2) in one process, each line saying whether its decode graph
    replayed (on the H200 the first image should; here the model is on the CPU, so graphs are off)."""
    by_what = _bench("bench_session.py", "--tiny", "--device", "cpu", "--small", "2")
    prompts = by_what["session_prompt"]
    assert [p["label"] for p in prompts] == ["t2i_512", "t2i_512"] and all(p["changed_prompt"] for p in prompts)
    assert all(p["decode_graph"].startswith("off") for p in prompts)
    assert by_what["session_summary"][0]["errors"] == 0


def test_bench_session_trace_labels_every_node_and_the_sampler_parts(tmp_path):
    """--trace: torch.profiler over prompts 2 and 3 (numbered from 0), one session_trace line each, every prompt's
    save time in its line, and the first traced prompt's Chrome trace with the node and sampler ranges in it (on
    the CPU there is no GPU work to split into busy and idle, and the line says so)."""
    by_what = _bench("bench_session.py", "--tiny", "--device", "cpu", "--turbo", "--tail", "0", "--trace",
                     "--log-dir", str(tmp_path))  # fmt: skip
    traces = by_what["session_trace"]
    assert [t["i"] for t in traces] == [2, 3]
    assert all(t["error"] == "no GPU work in the trace" and t["top_host_ops"] for t in traces)
    prompts = by_what["session_prompt"]
    assert all(p["save_s"] > 0 and p["total_s"] >= p["sample_s"] + p["decode_s"] + p["save_s"] for p in prompts)
    names = {event.get("name") for event in json.loads((tmp_path / "session_trace_fp8_2.json").read_text())[
        "traceEvents"]}  # fmt: skip
    assert {"node Qwen21Encode", "node Qwen21Sampler", "node Qwen21VAEDecode", "node Qwen21SaveImage", "qwen21 prefill",
            "qwen21 step"} <= names  # fmt: skip


def test_gpu_timeline_puts_each_idle_gap_on_the_host_range_it_began_in(monkeypatch):
    """benchmarks/_trace.py on a made-up trace: busy is the union of GPU work (overlaps counted once), a gap goes to
    the innermost labelled ranges the host was in while it lasted, short gaps are only summed, and the GPU side of a
    user annotation is not work; what each host thread ran during the long gaps is its innermost event then ("python in
    <range>" where only our range was open), the node ranges' thread counted as the main one."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from types import SimpleNamespace

    from _trace import gpu_timeline

    def event(name, device, start, end, thread=1, shapes=None):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), thread=thread, input_shapes=shapes,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    trace = [
        event("node Qwen21Sampler", "CPU", 0, 10_000),
        event("qwen21 prefill", "CPU", 0, 3_000),
        event("qwen21 prefill", "CUDA", 0, 3_000),  # the annotation's GPU copy: not work
        event("node SaveImage", "CPU", 10_000, 14_000),
        event("gemm", "CUDA", 1_000, 2_000),
        event("gemm", "CUDA", 1_500, 2_500),  # overlaps the first: 1.5 ms busy together
        event("norm", "CUDA", 2_600, 9_000),  # 0.1 ms gap before it: short
        event("aten::to", "CPU", 9_200, 9_800, shapes=[[4096, 64], []]),  # the host in an op while the GPU idles
        event("aten::_copy", "CPU", 9_300, 9_500),  # nested: the innermost counts
        event("aten::empty", "CPU", 9_900, 9_900),  # an instant: nothing
        event("compile", "CPU", 0, 12_000, thread=7),  # a warm-up thread
        event("load", "CPU", 500, 600, thread=7),
    ]
    timeline = gpu_timeline(SimpleNamespace(events=lambda: trace))
    assert timeline["wall_ms"] == 14.0 and timeline["gpu_busy_ms"] == 7.9
    assert timeline["idle_in_short_gaps_ms"] == 0.1
    # the last kernel ends at 9 ms, inside the sampler's range; the GPU then idles to the end of SaveImage
    assert timeline["idle_by_host_range_ms"] == {"node SaveImage": 4.0, "qwen21 prefill": 1.0,
                                                 "node Qwen21Sampler": 1.0}  # fmt: skip
    assert timeline["longest_gaps"][0] == {"ms": 5.0, "at_ms": 9.0, "host": "node Qwen21Sampler"}
    assert timeline["top_gpu_work"][0] == {"name": "norm", "calls": 1, "ms": 6.4}
    assert timeline["idle_main_thread_ms"] == {"python in node SaveImage": 4.0,
                                               "python in qwen21 prefill": 1.0, "python in node Qwen21Sampler": 0.4,
                                               "aten::to in node Qwen21Sampler": 0.4,
                                               "aten::_copy in node Qwen21Sampler": 0.2}  # fmt: skip
    # the nested op has no shapes of its own: it is named with the op around it that has
    assert timeline["idle_longest_events"] == [{"ms": 0.4, "event": "aten::to", "shapes": "[[4096, 64]]"},
                                               {"ms": 0.2, "event": "aten::to > aten::_copy",
                                                "shapes": "[[4096, 64]]"}]  # fmt: skip
    # the warm-up thread: "compile" over both long gaps (to 12 ms) less the 0.1 ms of "load" inside the first; the
    # rest of SaveImage's gap is past its last event
    assert timeline["idle_other_threads_ms"] == {"compile": 3.9, "load": 0.1}


@pytest.mark.slow
def test_bench_comfyui_session_writes_files_our_loaders_read_as_comfy_orgs_fp8_scaled(tmp_path, monkeypatch):
    """The full-size file writers of bench_comfyui_session.py, on the tiny models: the DiT and the text encoder as
    fp8_scaled files (block / language-model Linears fp8, the rest bf16), the VAE in bf16, all in ComfyUI's layouts,
    read back by our loaders."""
    monkeypatch.syspath_prepend(str(BENCH_VAE.parent))
    import bench_comfyui_session as bench
    import torch
    from qwen21_nodes.qwen21_core.checkpoints import loading
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
    from qwen21_nodes.qwen21_core.text.encoder import decoder_linear_names
    from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER, TINY_VAE
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    torch.manual_seed(0)
    dit = QwenImage21Transformer(TINY_TRANSFORMER).to(torch.bfloat16)
    bench.write_dit(tmp_path / "dit.safetensors", dit)
    loaded, info = loading.load_transformer(tmp_path / "dit.safetensors", "cpu", torch.bfloat16)
    assert (info["layout"], info["stored"]) == ("comfyui", "fp8 e4m3fn, scaled")
    assert info["weights"] == f"fp8 ({4 * TINY_TRANSFORMER.num_layers}/{4 * TINY_TRANSFORMER.num_layers} block linears)"
    assert torch.equal(loaded.img_in.weight, dit.img_in.weight)  # outside the blocks: bf16, as it was

    text, processor = build_tiny_text_encoder()
    bench.write_text_encoder(tmp_path / "te.safetensors", text)
    (tmp_path / "te.json").write_text(text.config.to_json_string())
    processor.save_pretrained(tmp_path / "te")
    encoder, info = loading.load_qwen3vl(tmp_path / "te.safetensors", "cpu", torch.float32)
    linears = len(decoder_linear_names(text.model))  # every Linear of its language model
    assert info["stored"] == "fp8 e4m3fn, scaled" and info["weights"].startswith(f"fp8 ({linears}/")

    vae = QwenImage21VAE(TINY_VAE)
    bench.write_vae(tmp_path / "vae.safetensors", vae)
    loaded_vae, info = loading.load_vae(tmp_path / "vae.safetensors", "cpu", torch.float32)
    assert (info["layout"], info["stored"]) == ("comfyui", "bfloat16")
    assert torch.equal(loaded_vae.decoder.conv_out.weight, vae.decoder.conv_out.weight.bfloat16().float())


@pytest.mark.slow
@pytest.mark.comfyui
@needs_comfyui_server
def test_bench_comfyui_session_smoke_runs_the_session_through_a_comfyui_server(tmp_path):
    """bench_comfyui_session --tiny on the CPU: bench_session's prompts queued over ComfyUI's HTTP API, every one
    ending in success, with ComfyUI's own output cache at work (the loader runs once, the seed-only rerun reuses
    the encoder's output, the LoRA node runs when its strength changes)."""
    pytest.importorskip(
        "websocket", reason="bench_comfyui_session needs websocket-client (pip install websocket-client)"
    )
    by_what = _bench("bench_comfyui_session.py", "--tiny", "--device", "cpu", "--tail", "1", "--log-dir", str(tmp_path))
    prompts, (summary,) = by_what["session_prompt"], by_what["session_summary"]
    assert all(line["via"] == "comfyui" and line["comfyui_flags"][0] == "--cpu" for line in prompts + [summary])
    assert [p for p in prompts if "error" in p] == [] and summary["errors"] == 0
    assert len(prompts) == summary["prompts"] == 15  # bench_session's plan with a tail of 1
    assert "loader_s" in prompts[0] and "Qwen21ModelLoader" not in prompts[0]["cached"]
    assert all("Qwen21ModelLoader" in p["cached"] and "loader_s" not in p for p in prompts[1:])
    (rerun,) = [p for p in prompts if not p["changed_prompt"]]
    assert "Qwen21Encode" in rerun["cached"] and "encode_s" not in rerun
    changed = [p for p in prompts if p["changed_prompt"]]
    # a changed prompt's encode runs (not served from the cache); its time may round to 0.0 s on the tiny model
    assert all("Qwen21Encode" not in p["cached"] and p["encode_s"] >= 0 for p in changed)
    lora = [p for p in prompts if p["lora_strength"] is not None]
    # the LoRA node runs for both (not cached); its own time may round to 0.0 s: it only makes a handle, the file
    # read as the strength changes is kept by the pipeline, and the merge happens in the sampler
    assert [p["lora_strength"] for p in lora] == [1.0, 0.6]
    assert all("Qwen21LoraLoader" not in p["cached"] and p["lora_s"] >= 0 for p in lora)
    assert all(p["total_s"] >= p["sample_s"] + p["decode_s"] and p["sample_inner_s"] > 0 for p in prompts)
    assert summary["first_image_s"] > 0 and summary["steady_image_s"] > 0 and summary["changed_prompt_ratio"] >= 1
    assert "Requested to load Qwen21ComfyModel" in (tmp_path / "comfyui_session_server_qwen21_none.txt").read_text()


@pytest.mark.slow
@pytest.mark.comfyui
@needs_comfyui_server
def test_bench_comfyui_session_runs_ksampler_on_our_model_beside_our_sampler(tmp_path):
    """--samplers qwen21,ksampler: the same prompts through Qwen21 Sampler and through KSampler on the loader's
    MODEL (LoraLoaderModelOnly for the LoRA prompts), each line counting the model calls, the prefix computations
    (one per conditioning at cfg 1) and the replayed steps, and a line comparing the two sessions' steady images."""
    pytest.importorskip("websocket", reason="bench_comfyui_session needs websocket-client")
    by_what = _bench("bench_comfyui_session.py", "--tiny", "--device", "cpu", "--tail", "1", "--limit", "5",
                     "--samplers", "qwen21,ksampler", "--log-dir", str(tmp_path))  # fmt: skip
    rows = {name: [p for p in by_what["session_prompt"] if p["sampler"] == name] for name in ("qwen21", "ksampler")}
    assert [len(rows["qwen21"]), len(rows["ksampler"])] == [5, 5]
    assert not [p for p in by_what["session_prompt"] if "error" in p]
    for row in rows["ksampler"]:
        assert row["model_calls"] == 2 and row["prefix_computations"] == 1 and row["replayed_steps"] == 0  # CPU
        assert "KSampler" not in row["cached"] and row["sample_s"] > 0
    assert all("model_calls" not in row for row in rows["qwen21"])
    (compared,) = by_what["ksampler_vs_qwen21"]
    assert compared["steady_ratio"] > 0


@pytest.mark.slow
def test_bench_cold_start_smoke_measures_each_child_and_the_launch_overhead():
    by_what = _bench("bench_cold_start.py", "--tiny", "--device", "cpu")
    rows = by_what["cold_start"]
    assert [(r["format"], r["warmup"]) for r in rows] == [("fp8", "off"), ("fp8", "on")]
    assert all(r["first_step_s"] > 0 and r["vae_first_s"] > 0 for r in rows)
    overhead = _bench("bench_cold_start.py", "--tiny", "--device", "cpu", "--launch-overhead", "--profile",
                      "--rounds", "2", "--trace")  # fmt: skip
    # --trace: each format's prefills under torch.profiler, the host's ops by own time
    traces = overhead["prefill_trace"]
    assert [t["format"] for t in traces] == ["bf16", "fp8"] and all(t["top_host_ops"] for t in traces)
    overhead = overhead["launch_overhead"]
    # on the CPU only Triton's path (the direct launch needs CUDA); each format's line compares with bf16's
    assert [(r["format"], r["launch"]) for r in overhead] == [("bf16", "triton"), ("fp8", "triton")]
    assert all(r["decode_eager_ms"] > 0 and r["profile_tottime_top"] for r in overhead)
    # interleaved rounds, each timed, the prefill too
    assert all(len(r["decode_eager_rounds_ms"]) == 2 == len(r["prefill_rounds_ms"]) for r in overhead)
    assert overhead[1]["prefill_vs_bf16"] > 0
    assert overhead[1]["eager_vs_bf16"] > 0


@pytest.mark.slow
def test_bench_text_encoder_dequant_times_both_ways_and_finds_them_identical():
    """--dequant on the CPU (where both ways are torch's expression: the kernel serves CUDA only): changed-prompt
    encodes per image count and the single-layer line, with the fields the H200 run fills."""
    path = BENCH_VAE.parent / "bench_text_encoder.py"
    done = subprocess.run([sys.executable, str(path), "--tiny", "--device", "cpu", "--dequant", "--repeats", "2",
                           "--images", "0,1"], capture_output=True, text=True, timeout=600, cwd=path.parents[1],
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["case"]: r for r in map(json.loads, filter(lambda line: line.startswith("{"), done.stdout.splitlines()))}
    for count in (0, 1):
        row = rows[f"dequant {count} images"]
        assert row["format"] == "fp8" and row["kernel"] is False and row["changed_prompts"] == 2 and row["identical"]
        assert row["torch_dequant_s"] > 0 and row["kernel_dequant_s"] > 0 and row["speedup"] > 0
    assert rows["dequant 1 images"]["tokens"] > rows["dequant 0 images"]["tokens"]
    layer = rows["dequant layer"]
    assert layer["shape"] == [256, 768] and layer["rows"] == 128 and layer["identical"]
    assert all(layer[f"{way}_{what}ms"] > 0 for way in ("torch", "kernel") for what in ("", "dequant_only_"))


def test_tune_kernels_lists_every_key_the_dit_meets():
    """--list needs no GPU: the block's four projections and nine quantiser modes, at each of the 11 M buckets."""
    keys = _bench("tune_kernels.py", "--list", timeout=120)["tune_key"]
    assert len(keys) == (4 + 9) * 11
    assert {k["kernel"] for k in keys} == {"int8_gemm", "quantize_rows"}
    assert all(k["candidates"] >= 1 and k["rule"] for k in keys)


def test_bench_edit_encode_times_both_paths_and_finds_them_identical():
    by_what = _bench("bench_edit_encode.py", "--tiny", "--device", "cpu", "--repeats", "2")
    (first,) = by_what["edit_first_call"]
    parts = ("text_only_s", "processor_s", "patch_embed_s", "vision_tower_s", "encode_prompts_s", "vae_encode_s")
    assert all(len(first[part]) == 2 for part in parts)
    rows = by_what["edit_encode"]
    assert [r["references"] for r in rows] == [1, 4]
    for row in rows:
        assert row["identical"] and row["cached_s"] > 0 and row["afresh_s"] > 0
        # one fill, then a hit per reference per cached prompt
        assert row["cache_misses"] == row["references"] and row["cache_hits"] == 2 * row["references"]
        assert set(row["host_per_reference"]) == {"digest_ms", "prepare_ms", "float_copy_ms"}


@pytest.mark.slow
@pytest.mark.comfyui
@needs_comfyui_server
def test_bench_comfyui_session_runs_the_first_prompts_with_the_pack_it_is_given(tmp_path):
    """--limit and --pack-dir (h200.sh comfyui-restart compares the first images of two releases through ComfyUI):
    the plan's first prompts only, with ComfyUI loading the pack from the given folder, here a copy of this tree
    whose node import logs a marker."""
    import shutil

    pytest.importorskip("websocket", reason="bench_comfyui_session needs websocket-client")
    repo = BENCH_VAE.parents[1]
    pack = tmp_path / "other_release"
    skipped = shutil.ignore_patterns(".git", ".venv", ".probe", ".whl", ".carry", "__pycache__", "artifacts", "tests")
    shutil.copytree(repo, pack, ignore=skipped)
    init = pack / "nodes" / "__init__.py"
    init.write_text(init.read_text() + "\nlog.warning('qwen21 pack marker: the copy')\n")
    by_what = _bench("bench_comfyui_session.py", "--tiny", "--device", "cpu", "--limit", "2", "--pack-dir", str(pack),
                     "--log-dir", str(tmp_path / "log"))  # fmt: skip
    (setup,), prompts = by_what["session_setup"], by_what["session_prompt"]
    assert setup["pack"] == str(pack.resolve())
    assert [p["i"] for p in prompts] == [0, 1] and not [p for p in prompts if "error" in p]
    assert "qwen21 pack marker: the copy" in (tmp_path / "log" / "comfyui_session_server_qwen21_none.txt").read_text()


def test_bench_loader_node_loads_in_fresh_processes_with_each_package(tmp_path):
    """bench_loader_node.py on the tiny files: one fresh process per (round, package), each importing the package it
    was given (here this checkout twice), with the load's phases, each component's read and the top functions."""
    repo = str(Path(__file__).resolve().parents[1])
    lines = _bench("bench_loader_node.py", "--tiny", "--device", "cpu", "--rounds", "1", "--models-dir",
                   str(tmp_path), "--pack-dirs", repo, repo)["loader_node"]  # fmt: skip
    assert [line["pack"] for line in lines] == [repo, repo]
    for line in lines:
        assert line["load_s"] > 0 and line["read_threads"] >= 4
        assert {"load_transformer", "load_vae", "load_qwen3vl", "load_processor"} <= set(line["phases"])
        assert [read["what"] for read in line["reads"]] == ["Qwen-Image-2.1 transformer", "Qwen-Image-2.1 VAE",
                                                            "Qwen3-VL text encoder"]  # fmt: skip
        assert line["top_cumulative"][0]["function"].startswith("loader.py")


def test_bench_session_settle_waits_for_the_warmup_before_the_first_prompt(monkeypatch):
    """--settle: the session waits for the kernel warm-up (all its parts) before its first prompt and reports the
    seconds; without a warm-up (CPU) it waits for nothing."""
    monkeypatch.syspath_prepend(str(BENCH_VAE.parent))
    import time
    from types import SimpleNamespace

    import bench_session

    class Warmup:
        waited_for = None

        def wait(self, *names):
            time.sleep(0.05)
            Warmup.waited_for = names

    cpu = torch.device("cpu")  # no priming to wait for on a CPU
    assert bench_session.settle(SimpleNamespace(pipe=SimpleNamespace(kernel_warmup=Warmup(), device=cpu))) >= 0.05
    assert Warmup.waited_for == ()  # every part
    assert bench_session.settle(SimpleNamespace(pipe=SimpleNamespace(kernel_warmup=None, device=cpu))) < 0.05
    summary = _bench("bench_session.py", "--tiny", "--device", "cpu", "--small", "1", "--settle")["session_summary"][0]
    assert summary["settled_s"] >= 0 and summary["errors"] == 0


def test_bench_lora_writes_the_same_lora_in_peft_and_in_comfyuis_key_names(tmp_path, monkeypatch):
    """The KSampler session loads its LoRA through ComfyUI's LoraLoaderModelOnly, which reads only the key names
    ComfyUI saves: bench_lora's "comfyui" layout must hold the same deltas as its PEFT one, on every block linear."""
    monkeypatch.syspath_prepend(str(BENCH_VAE.parent))
    from _common import random_dit
    from bench_lora import BLOCK_LINEARS, TINY_LORA_CONFIG, write_lora
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.lora.merge import layer_shapes
    from qwen21_nodes.qwen21_core.lora.reading import read_lora

    model = random_dit(TransformerConfig(**TINY_LORA_CONFIG), torch.device("cpu"), torch.float32)
    shapes = layer_shapes(model)
    deltas = {}
    for layout in ("peft", "comfyui"):
        lora = read_lora(write_lora(tmp_path / f"{layout}.safetensors", model, 4, seed=3, layout=layout), shapes)
        deltas[layout] = {layer.layer: (layer.up.float() @ layer.down.float()) * layer.scale for layer in lora.layers}
    assert len(deltas["comfyui"]) == model.config.num_layers * len(BLOCK_LINEARS)
    assert deltas["comfyui"].keys() == deltas["peft"].keys()
    for name, delta in deltas["peft"].items():
        assert torch.equal(deltas["comfyui"][name], delta), name
        assert delta.abs().max() > 0


@pytest.mark.parametrize("label, size", [("t2i_1344x768", (1344, 768)), ("t2i_1024", (1024, 1024))])
def test_the_ksampler_session_samples_each_prompt_at_our_samplers_size(monkeypatch, label, size):
    """as_ksampler gives KSampler a latent of the size Qwen21 Sampler samples (an H200 run sampled 1344x768 prompts
    at 1344x1344 through Qwen21 Encode's square latent): Qwen21 Empty Latent at the sampler's width and height."""
    import argparse

    from qwen21_nodes.nodes.latent import Qwen21EmptyLatent

    monkeypatch.syspath_prepend(str(BENCH_VAE.parent))
    from bench_comfyui_session import as_ksampler
    from bench_session import session_prompt

    args = argparse.Namespace(tiny=False, steps=2, save_node="")
    prompt = as_ksampler(session_prompt({"label": label, "changed": True, "lora": None}, 0, args, None, 0))
    (sampler,) = [node for node in prompt.values() if node["class_type"] == "KSampler"]
    source, _output = sampler["inputs"]["latent_image"]
    assert prompt[source]["class_type"] == "Qwen21EmptyLatent"
    (latent,) = Qwen21EmptyLatent().make(**prompt[source]["inputs"])
    assert latent["samples"].shape == (1, 64, size[1] // 16, size[0] // 16)


@pytest.mark.slow
@pytest.mark.comfyui
@needs_comfyui_server
def test_bench_comfyui_session_runs_fun_control_through_both_samplers(tmp_path):
    """--control: the text-to-image prompts run with Fun-Control (make_tiny's branch) through Qwen21 Sampler and
    through KSampler, every step controlled, each prompt ending in success, the KSampler line naming the control."""
    pytest.importorskip("websocket", reason="bench_comfyui_session needs websocket-client")
    by_what = _bench("bench_comfyui_session.py", "--tiny", "--device", "cpu", "--limit", "2", "--control",
                     "--samplers", "qwen21,ksampler", "--log-dir", str(tmp_path))  # fmt: skip
    prompts = by_what["session_prompt"]
    assert [(p["sampler"], p["i"]) for p in prompts] == [("qwen21", 0), ("qwen21", 1), ("ksampler", 0), ("ksampler", 1)]
    assert not [p for p in prompts if "error" in p]
    steps = 2  # --tiny runs 2 steps
    assert [p["model_calls"] for p in prompts[2:]] == [steps, steps]
    assert [p["control_status"] for p in prompts] == [f"{steps}/{steps} steps at strength 1"] * 2 + [
        f"{steps}/{steps} calls at strength 1"] * 2  # fmt: skip
    assert all(p["control"] for p in prompts) and by_what["ksampler_vs_qwen21"][0]["control"] is True
    assert "Qwen21ApplyControlModel" in prompts[3]["cached"]  # the second prompt reuses the applied MODEL


@pytest.mark.slow
@pytest.mark.comfyui
@needs_comfyui_server
def test_bench_comfyui_session_runs_a_gguf_dit_through_both_samplers(tmp_path):
    """--dit q4_k_m on the tiny files: the loader reads make_tiny's GGUF DiT (weight_dtype auto), every prompt through
    Qwen21 Sampler and KSampler ends in success, the lines name the file, and door_ratios compares the KSampler
    session with the same file's uncapped Qwen21 Sampler one."""
    pytest.importorskip("websocket", reason="bench_comfyui_session needs websocket-client")
    by_what = _bench("bench_comfyui_session.py", "--tiny", "--device", "cpu", "--limit", "2", "--dit", "q4_k_m",
                     "--samplers", "qwen21,ksampler", "--log-dir", str(tmp_path))  # fmt: skip
    prompts = by_what["session_prompt"]
    assert len(prompts) == 4 and not [p for p in prompts if "error" in p]
    assert {p["dit"] for p in prompts} == {"q4_k_m"}
    log = (tmp_path / "comfyui_session_server_qwen21_q4_k_m_none.txt").read_text()
    assert "qwen_image_2.1_tiny_Q8_0.gguf" in log and "(weights auto)" in log
    import importlib.util

    spec = importlib.util.spec_from_file_location("door_ratios", BENCH_VAE.parent / "door_ratios.py")
    door = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(door)
    (row,) = door.ratios(by_what["session_summary"])  # no fp8 baseline here: the same file's
    assert row["sampler"] == "ksampler" and row["dit"] == "q4_k_m" and row["ratio"] is None
    assert row["same_dit_ratio"] == pytest.approx(row["steady_image_s"] / row["same_dit_steady_s"], abs=2e-3)


def test_bench_control_smoke_runs_every_path_with_its_control_counts():
    """bench_control --tiny on the CPU: the plain, controlled, half-range, changed-prompt and KSampler-way runs each
    report how many steps ran controlled, and the ratios are the figures they are computed from."""
    lines = _bench("bench_control.py", "--tiny", "--device", "cpu", "--steps", "3", "--profile", "--control-stream")
    (row,) = lines["control_vs_plain"]
    assert row["plain_control"] == "off"
    assert row["controlled_control"] == row["changed_prompt_controlled_control"] == "3/3 steps at strength 1"
    assert row["half_control"] == "2/3 steps at strength 1"  # start 0, end 0.5 of 3 steps
    assert row["ksampler_controlled_control"] == "3/3 calls at strength 1"
    assert row["controlled_step_ratio"] == pytest.approx(row["controlled_step_ms"] / row["plain_step_ms"], abs=1e-3)
    steps_s = 3 * row["controlled_step_ms"] / 1000
    assert row["changed_prompt_ratio"] == pytest.approx(row["changed_prompt_controlled_s"] / steps_s, abs=1e-3)
    assert row["ksampler_ratio"] == pytest.approx(row["ksampler_controlled_step_ms"] / row["controlled_step_ms"],
                                                  abs=1e-3)  # fmt: skip
    # fp8 (the default): one controlled run with bf16 skips first, then the skips quantised; their latents differ
    assert row["controlled_bf16_skips_control"] == "3/3 steps at strength 1"
    assert 0 < row["quantised_skips_rel_rms"] < 0.1
    ratio = row["controlled_bf16_skips_step_ms"] / row["controlled_step_ms"]
    assert row["quantised_skips_speedup"] == pytest.approx(ratio, abs=1e-3)
    # --control-stream: the controlled run again with the setting on (on a CPU one stream: the same latents)
    assert row["controlled_stream_control"] == "3/3 steps at strength 1" and row["control_stream_identical"] is True
    ratio = row["controlled_step_ms"] / row["controlled_stream_step_ms"]
    assert row["control_stream_speedup"] == pytest.approx(ratio, abs=1e-3)
    # --profile: one line per path, its kinds summing to the step's total, the controlled step holding more work
    plain, controlled = lines["control_profile"]
    assert (plain["path"], controlled["path"]) == ("plain", "controlled")
    for line in (plain, controlled):
        assert line["step_kernel_ms"] == pytest.approx(sum(line["kinds_ms"].values()), abs=0.05)
        assert line["top"] and all(ms >= 0 for _, ms, _ in line["top"])
    matmuls = {
        p["path"]: sum(n for name, _, n in p["top"] if name in ("aten::mm", "aten::addmm"))
        for p in lines["control_profile"]
    }
    assert matmuls["controlled"] > matmuls["plain"]  # the branch's blocks and after_proj are in the recorded steps


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_bench_gguf_random_rows_read_back_with_the_spread_asked_for(monkeypatch, qtype):
    """random_gguf_rows: blocks that gguf's own dequantiser reads as finite values centred on 0 (within an eighth of
    the spread, Q4_0 half a code off) with the standard deviation asked for (within 5%)."""
    gguf = pytest.importorskip("gguf")
    monkeypatch.syspath_prepend(str(BENCH_VAE.parent))
    from bench_gguf import random_gguf_rows

    rows = random_gguf_rows(qtype, 32, 1024, 0.02, "cpu", torch.Generator().manual_seed(0))
    values = gguf.quants.dequantize(rows.numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    assert values.shape == (32, 1024) and bool(torch.from_numpy(values).isfinite().all())
    assert abs(float(values.mean())) < 0.12 * 0.02 and float(values.std()) == pytest.approx(0.02, rel=0.05)


def test_bench_comfyui_session_writes_a_q4_k_m_gguf_our_loader_keeps_quantised(tmp_path, monkeypatch):
    """write_gguf_dit: ComfyUI-GGUF's layout with Q4_K blocks, Q6_K for to_v and the MLP out in every other block,
    the rest as it was (bf16 matrices, F32 vectors), loaded by our loader with its blocks as stored."""
    pytest.importorskip("gguf")
    monkeypatch.syspath_prepend(str(BENCH_VAE.parent))
    import bench_comfyui_session as bench
    from qwen21_nodes.qwen21_core.checkpoints import loading
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
    from qwen21_nodes.qwen21_core.quant.gguf_linear import GGUFLinear

    torch.manual_seed(0)  # inner width 256: one K-quant block per row
    dit = QwenImage21Transformer(TransformerConfig(num_layers=2, num_attention_heads=2, context_in_dim=256))
    bench.write_gguf_dit(tmp_path / "dit.gguf", dit.to(torch.bfloat16))
    loaded, info = loading.load_transformer(tmp_path / "dit.gguf", "cpu", torch.bfloat16)
    assert (info["layout"], info["stored"]) == ("comfyui", "GGUF")
    types = {name: layer.fmt.types for name, layer in loaded.named_modules() if isinstance(layer, GGUFLinear)}
    assert types["transformer_blocks.0.attn.to_qkv"] == ("Q4_K", "Q4_K", "Q6_K")
    assert types["transformer_blocks.0.img_mlp.out"] == ("Q6_K",)
    assert types["transformer_blocks.1.attn.to_qkv"] == ("Q4_K",) * 3
    assert types["transformer_blocks.1.img_mlp.out"] == ("Q4_K",)
    assert len(types) == 8  # every block Linear
    assert torch.equal(loaded.img_in.weight, dit.img_in.weight) and not (tmp_path / "dit.gguf.part").exists()


def test_door_ratios_compare_each_session_with_the_uncapped_baselines_of_its_run():
    """door_ratios: every session against the uncapped Qwen21 Sampler one on the fp8 file of the same package and
    control setting (the first with a steady image), a GGUF session also against its own file's uncapped one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("door_ratios", BENCH_VAE.parent / "door_ratios.py")
    door = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(door)

    def summary(sampler, dit, cap, steady, code="a", control=False):
        return dict(what="session_summary", sampler=sampler, dit=dit, cap_gib=cap, cfg=1.0, steady_image_s=steady,
                    code=code, control=control, comfyui_flags=[], prompts=12, errors=0)  # fmt: skip

    lines = [summary("qwen21", "fp8", None, None), summary("qwen21", "fp8", None, 2.0),
             summary("qwen21", "fp8", None, 9.0, code="b"), summary("qwen21", "fp8", None, 3.0, control=True),
             summary("ksampler", "fp8", 16.0, 2.5), summary("qwen21", "q4_k_m", None, 2.2),
             summary("ksampler", "q4_k_m", 8.0, 3.3), summary("ksampler", "fp8", 16.0, 3.6, control=True)]  # fmt: skip
    rows = door.ratios(lines)
    by = {(r["sampler"], r["dit"], r["cap_gib"], r["control"]): r for r in rows if r["steady_image_s"]}
    assert by[("ksampler", "fp8", 16.0, False)]["ratio"] == 1.25
    assert by[("ksampler", "fp8", 16.0, True)]["ratio"] == 1.2  # against the controlled baseline
    gguf = by[("ksampler", "q4_k_m", 8.0, False)]
    assert (gguf["ratio"], gguf["same_dit_ratio"]) == (1.65, 1.5)
    assert by[("qwen21", "q4_k_m", None, False)]["ratio"] == 1.1
    assert ("qwen21", "fp8", None, False) not in by  # the baseline itself


def test_bench_gguf_smoke_times_each_type_and_the_k_quants_first_kernel():
    """bench_gguf --tiny on the CPU: the kernel-only lines per type (the K-quants also through their first, flat
    kernel, bit-identical), then the step line per variant with its ratios to bf16."""
    kernel = _bench("bench_gguf.py", "--tiny", "--device", "cpu", "--kernel-only", "--types", "Q8_0,Q4_K,Q6_K")
    lines = {line["qtype"]: line for line in kernel["gguf_dequant_kernel"]}
    assert set(lines) == {"Q8_0", "Q4_K", "Q6_K"} and "flat_dequant_ms" not in lines["Q8_0"]
    for qtype in ("Q4_K", "Q6_K"):
        line = lines[qtype]
        assert line["bit_identical"] is True
        ratio = line["dequant_ms"] / line["flat_dequant_ms"]
        assert line["tiled_over_flat"] == pytest.approx(ratio, rel=0.02, abs=2e-3)
    steps = _bench("bench_gguf.py", "--tiny", "--device", "cpu", "--types", "Q8_0", "--steps", "3", "--repeats", "1",
                   "--eager", "--prefetch")  # fmt: skip
    rows = {row["variant"]: row for row in steps["gguf_step"]}
    assert set(rows) == {"bf16", "Q8_0"} and rows["bf16"]["vs_bf16"] == 1.0
    # --prefetch: the GGUF variant again with the setting on (on a CPU the plain path: the same latents)
    assert "prefetch_step_ms" not in rows["bf16"] and rows["Q8_0"]["prefetch_identical"] is True
    ratio = rows["Q8_0"]["step_ms"] / rows["Q8_0"]["prefetch_step_ms"]
    assert rows["Q8_0"]["prefetch_speedup"] == pytest.approx(ratio, abs=2e-3)
    assert rows["Q8_0"]["vs_bf16"] == pytest.approx(rows["Q8_0"]["step_ms"] / rows["bf16"]["step_ms"], abs=1e-3)
    assert rows["Q8_0"]["block_gib"] < rows["bf16"]["block_gib"]
