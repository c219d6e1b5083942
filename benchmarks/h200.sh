#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on the H200 machine (the device tool), writing JSON lines and logs
# to $OUT. Usage: bash benchmarks/h200.sh PART... where PART is one of
#   tests tests-vae tests-quant demo dit dit-quick dit-batch dit-quant dit-quant-1024 dit-quant-profile quant vae
#   vae-mem vae-placeholders vae-profile qk te te-dequant load lora server-gpu tests-memory e2e tune cold overhead
#   tests-kernels-gpu tests-graphs session session-turbo session-comfyui comfyui-restart tests-gpu-all copy-rates
#   attention-lengths save-png loader-node session-comfyui-ksampler tests-door velocity session-door gguf control
#   tests-control gguf-kernel tests-gguf
# The machine has torch, triton and transformers; diffusers 0.42.1 (the reference) travels as a wheel in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/pkg
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
ln -sfn "$PWD" /tmp/pkg/qwen21_nodes
# comfy-kitchen (the fused ops ComfyUI uses), carried in .ck/ for the comparisons (QK-norm+RoPE, int8_linear)
if ls .ck/*.tar.xz >/dev/null 2>&1; then tar xJf .ck/*.tar.xz -C /tmp/pkg; fi
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

run() {  # run NAME SECONDS COMMAND...: time-box one part so a hang cannot eat the whole call
  local name=$1 limit=$2
  shift 2
  echo "=== $name" | tee -a "$OUT/summary.txt"
  local start=$SECONDS
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  echo "=== $name rc=$? $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
}

unpack_comfyui() {  # ComfyUI from .carry/comfyui (benchmarks/comfyui_carry.sh) into /tmp/comfyui, its missing
  # requirements into /tmp/comfysite; PyAV is replaced by a stand-in module, the frontend by an empty folder. Once a
  # machine: later parts find it there.
  [ -f /tmp/comfyui/.unpacked ] && return
  rm -rf /tmp/comfyui /tmp/comfysite && mkdir -p /tmp/comfyui /tmp/comfysite/av/subtitles /tmp/frontend
  tar xzf .carry/comfyui/comfyui.tar.gz -C /tmp/comfyui
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/comfysite .carry/comfyui/wheels/*.whl
  local stand_in='def __getattr__(name):  # a stand-in for PyAV: ComfyUI imports it at start, we never use it
    return type(name, (), {})'
  for module in av/__init__ av/container av/subtitles/__init__ av/subtitles/stream; do
    echo "$stand_in" > "/tmp/comfysite/$module.py"
  done
  touch /tmp/comfyui/.unpacked
}

comfyui_run() {  # run NAME SECONDS COMMAND... with the unpacked ComfyUI where the server tests and benchmarks look
  COMFYUI_DIR=/tmp/comfyui COMFYUI_PYTHON=python3 COMFYUI_EXTRA_ARGS="--front-end-root /tmp/frontend" \
    PYTHONPATH=/tmp/comfysite:$PYTHONPATH run "$@"
}

for part in "$@"; do
  case $part in
    tests)  # the GPU-marked tests, and the kernel tests on CUDA (their CPU-interpreter rerun is CI's job;
      # this machine's Triton 3.6 interpreter cannot index with its own scalars)
      run tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests
      run tests_kernels 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_*.py -k "not interpreter" ;;
    tests-vae) run tests_vae 200 python3 -m pytest -q -p no:cacheprovider -k "not interpreter" tests/test_vae.py \
      tests/test_kernel_self_tests.py \
      tests/test_vae_tiling.py tests/test_kernel_rmsnorm_silu.py tests/test_kernel_bias_residual.py ;;
    demo) run demo 120 python3 -m qwen21_nodes demo --tiny-dir /tmp/tiny --output-dir "$OUT/demo" ;;
    dit) run bench_dit 480 python3 benchmarks/bench_dit.py ;;
    dit-quick) run bench_dit 300 python3 benchmarks/bench_dit.py --cases 1024_ref0 --no-backends ;;
    dit-batch)  # batch 4 with today's K/V layout (one shared prefix, per-row target K/V transient): its line
      # replaces the first release's batch-4 line in tests/test_sampler.py's memory-estimate check
      run bench_dit_batch 300 python3 benchmarks/bench_dit.py --cases 1024_ref0_cfg1_b4 --no-compile --no-backends \
        --no-fp32 ;;
    quant) run bench_quant 100 python3 benchmarks/bench_quant.py ;;
    tests-quant) run tests_quant 150 python3 -m pytest -q -p no:cacheprovider -k "not interpreter" \
      tests/test_kernel_quantize.py tests/test_quant.py ;;
    dit-quant-1024)  # quantised formats at 1024^2 t2i, with the per-Linear errors, profile, 40-step quality, sensitivity
      run bench_dit_quant 320 python3 benchmarks/bench_dit.py --cases 1024_ref0_cfg1_b1 --formats fp8,int8,int8_convrot \
        --linear-errors --profile --quality --sensitivity fp8 --no-fp32 --bf16-only ;;
    dit-quant-profile)  # the 1024^2 t2i step per format and its profile only
      run bench_dit_quant 240 python3 benchmarks/bench_dit.py --cases 1024_ref0_cfg1_b1 --formats fp8,int8,int8_convrot \
        --profile --no-fp32 --bf16-only --no-reference ;;
    dit-quant)  # every size the issue names, each format beside bf16 and diffusers, with and without bf16 MLPs
      run bench_dit_quant 540 python3 benchmarks/bench_dit.py --cases 512_ref0_cfg1_b1,1024_ref0_cfg1_b1,1024_ref4_cfg1_b1,2048_ref0_cfg1_b1 \
        --formats fp8,int8,int8_convrot --keep-mlp --no-fp32 --bf16-only ;;
    tests-new)  # the GPU tests of the quantisation, memory and LoRA work, and its kernels on CUDA
      run tests_new 110 python3 -m pytest -q -p no:cacheprovider -k "not interpreter" tests/test_kernel_quantize.py \
        tests/test_kernel_attention_merge.py tests/test_quant.py tests/test_memory.py tests/test_lora.py \
        tests/test_lora_node.py tests/test_transformer.py tests/test_decode_graphs.py ;;
    tests-lora)  # the LoRA tests (GPU-marked ones included) and the quantised kernels on CUDA, 4 workers
      run tests_lora "${TESTS_LIMIT:-150}" python3 -m pytest -v -p no:cacheprovider -n 4 --timeout 100 -k "not interpreter" tests/test_lora.py \
        tests/test_lora_quant.py tests/test_lora_node.py tests/test_kernel_quantize.py tests/test_quant.py ;;
    tests-last)  # the GPU tests that failed or did not finish in the last tests-new run, one line per test
      run tests_last 70 python3 -m pytest -v -p no:cacheprovider -k "not interpreter and (1-256 or int8_gemm or gpu)" \
        tests/test_kernel_quantize.py tests/test_memory.py ;;
    tests-memory)  # the memory planner's, streaming's and decode graphs' GPU tests
      run tests_memory "${TESTS_LIMIT:-120}" python3 -m pytest -v -p no:cacheprovider -k "not interpreter" \
        tests/test_memory.py tests/test_decode_graphs.py ;;
    tune) run tune_kernels "${TUNE_LIMIT:-300}" python3 benchmarks/tune_kernels.py --out "$OUT/tuned" ;;
    cold) run bench_cold_start "${COLD_LIMIT:-400}" python3 benchmarks/bench_cold_start.py ;;
    overhead) run bench_overhead "${OVERHEAD_LIMIT:-200}" python3 benchmarks/bench_cold_start.py --launch-overhead ;;
    tests-kernels-gpu)  # the launch-configuration, warm-up and quantised-kernel tests on CUDA
      run tests_kernels_gpu "${TESTS_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -k "not interpreter" \
        tests/test_launch_configs.py tests/test_kernel_warmup.py tests/test_kernel_quantize.py tests/test_quant.py ;;
    tests-graphs)  # the prefill- and decode-graph GPU tests (replay against eager, bit for bit; cudaMallocAsync)
      run tests_graphs "${TESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_graphs.py \
        tests/test_decode_graphs.py ;;
    session) run bench_session "${SESSION_LIMIT:-560}" python3 benchmarks/bench_session.py --log-dir "$OUT" \
      --child-timeout "${SESSION_LIMIT:-560}" ${SESSION_ARGS:-} ;;
    session-turbo) run bench_session_turbo "${TURBO_LIMIT:-200}" python3 benchmarks/bench_session.py --turbo ;;
    tests-gpu-all)  # every GPU-marked test, and the kernel tests on CUDA
      run tests_gpu_all "${TESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider --timeout 120 -m gpu tests
      run tests_kernels_cuda "${TESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider --timeout 120 \
        -k "not interpreter" tests/test_kernel_quantize.py tests/test_launch_configs.py ;;
    e2e-short) run bench_e2e 330 python3 benchmarks/bench_e2e.py --no-diffusers ;;
    dit-final)  # the quantised formats at every size beside bf16 and diffusers (bf16 MLP variant at 1024^2)
      run bench_dit_final 300 python3 benchmarks/bench_dit.py \
        --cases 512_ref0_cfg1_b1,1024_ref0_cfg1_b1,1024_ref4_cfg1_b1,2048_ref0_cfg1_b1 \
        --formats fp8,int8,int8_convrot --keep-mlp --no-fp32 --bf16-only --profile ;;
    dit-kv)  # K/V layouts, formats, placements, block streaming, 40-step latents with quantised caches
      run bench_dit_kv 170 python3 benchmarks/bench_dit.py --cases 1024_ref0_cfg1_b1 --kv --no-fp32 --bf16-only \
        --no-reference --sensitivity int8_convrot ;;
    e2e) run bench_e2e "${E2E_LIMIT:-420}" python3 benchmarks/bench_e2e.py ${E2E_ARGS:-} ;;  # E2E_ARGS: --only, ...
    te-quant) run bench_te_quant 150 python3 benchmarks/bench_text_encoder.py --formats fp8,int8 --repeats 3 ;;
    te-dequant)  # the fp8 weight-only encoder's changed-prompt encode, torch's dequant vs the kernel, and its GPU tests
      run bench_te_dequant 240 python3 benchmarks/bench_text_encoder.py --dequant --no-reference --repeats 7
      run tests_dequant 120 python3 -m pytest -q -p no:cacheprovider -k "not interpreter" \
        tests/test_kernel_dequantize_weight.py ;;
    vae) run bench_vae 240 python3 benchmarks/bench_vae.py ;;
    vae-profile) run bench_vae_profile 150 python3 benchmarks/bench_vae.py --profile --sizes 1024 ;;
    vae-mem) run bench_vae_memory 150 python3 benchmarks/bench_vae.py --measure-memory --sizes 512 1024 ;;
    vae-placeholders) run bench_vae_placeholders "${VAE_LIMIT:-420}" python3 benchmarks/bench_vae.py --placeholders ${VAE_ARGS:-} ;;
    qk) run bench_qk 300 python3 benchmarks/bench_qk_norm_rope.py --sweep ;;
    te) run bench_te 200 python3 benchmarks/bench_text_encoder.py ;;
    copy-rates) run bench_copy_rates 60 python3 benchmarks/bench_copy_rates.py ;;
    save-png) run bench_save_png 120 python3 benchmarks/bench_save_png.py ;;  # ComfyUI's Save Image against ours
    attention-lengths)  # each attention kernel's first call at a new prompt length, and cuDNN against flash at repeats
      run bench_attention_lengths 90 python3 benchmarks/bench_attention_lengths.py ;;
    lora) run bench_lora "${LORA_LIMIT:-580}" python3 benchmarks/bench_lora.py ${LORA_ARGS:-} ;;  # LORA_ARGS: --formats ...
    load)
      run bench_load_ours 200 python3 benchmarks/bench_load.py --cases ours --caches warm
      run bench_load_diffusers 150 python3 benchmarks/bench_load.py --cases diffusers:diffusers --caches warm ;;
    server-gpu)  # the server tests that need ComfyUI on a GPU (--lowvram, --novram)
      unpack_comfyui
      comfyui_run server_gpu "${SERVER_LIMIT:-240}" python3 -m pytest -v -p no:cacheprovider \
        tests/test_comfyui_server.py -k lowvram ;;
    session-comfyui)  # bench_session's session once through a real ComfyUI (its default flags), full size, fp8.
      # The random files are 17.6 GB (from the shapes); bench_load wrote 14.2 GB in 15.1 s, so expect 20-30 s of
      # writing; a tail of 8 (22 prompts, as the in-process H200 sessions) keeps the rest inside the call
      unpack_comfyui
      comfyui_run bench_comfyui_session "${SESSION_COMFYUI_LIMIT:-540}" \
        python3 benchmarks/bench_comfyui_session.py --tail 8 --log-dir "$OUT" ${SESSION_COMFYUI_ARGS:-} ;;
    session-comfyui-ksampler)  # the same session through Qwen21 Sampler, then through KSampler on our MODEL (one
      # server each, same host and files): ksampler_vs_qwen21's steady_ratio is the changed-prompt image's cost of
      # the KSampler path; each KSampler line counts the prefix computations and replayed steps
      unpack_comfyui
      comfyui_run bench_comfyui_ksampler "${SESSION_COMFYUI_LIMIT:-560}" \
        python3 benchmarks/bench_comfyui_session.py --tail 4 --samplers qwen21,ksampler --log-dir "$OUT" \
        ${SESSION_COMFYUI_ARGS:-} ;;
    tests-door)  # the MODEL door under ComfyUI's memory management on the GPU (0.3.64 in-process, tiny model), and
      # the velocity and node GPU tests
      unpack_comfyui
      comfyui_run tests_door "${TESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_comfyui_gpu.py \
        tests/test_velocity.py tests/test_comfy_door_contract.py tests/test_gguf.py tests/test_control.py ;;
    gguf)  # GGUF DiT layers against bf16 and fp8: the step at 1024^2, and each type's dequantisation against its GEMM
      run bench_gguf_kernel 120 python3 benchmarks/bench_gguf.py --kernel-only --types Q8_0,Q6_K,Q5_K,Q4_K,Q4_0
      run bench_gguf "${GGUF_LIMIT:-300}" python3 benchmarks/bench_gguf.py ${GGUF_ARGS:-} ;;
    gguf-kernel)  # each GGUF type's dequantisation against its GEMM (the K-quants' tiled kernel against the flat one)
      run bench_gguf_kernel 120 python3 benchmarks/bench_gguf.py --kernel-only --types Q8_0,Q6_K,Q5_K,Q4_K,Q4_0 ;;
    tests-gguf)  # GGUF on CUDA: the kernel bit for bit against gguf's dequantiser, the prefetch trial's GPU test
      run tests_gguf "${TESTS_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -k "not interpreter" \
        tests/test_gguf.py ;;
    tests-control)  # Fun-Control's GPU tests and the door's small-card test (0.3.64 in-process, tiny model)
      unpack_comfyui
      comfyui_run tests_control "${TESTS_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_control.py \
        tests/test_comfyui_gpu.py ;;
    control)  # Fun-Control: controlled vs plain step, a half range, KSampler's way in; full size fp8 DiT and branch
      run bench_control "${CONTROL_LIMIT:-300}" python3 benchmarks/bench_control.py ${CONTROL_ARGS:-} ;;
    velocity)  # KSampler's way into the DiT (VelocityRun) against our sampler, full size fp8, per size; profiles
      run bench_velocity "${VELOCITY_LIMIT:-200}" python3 benchmarks/bench_velocity.py --profile ${VELOCITY_ARGS:-} ;;
    session-door)  # a ComfyUI server session on the full-size files: DOOR_DIT (fp8 and/or q4_k_m, a GGUF DiT),
      # DOOR_SAMPLER (ksampler or qwen21), card sizes DOOR_CAPS (GiB, one server each; none: the whole card), guidance
      # scales DOOR_CFGS, DOOR_PROMPTS prompts per scale, DOOR_ARGS more flags (--extra-args=--lowvram); the log is
      # $OUT/DOOR_NAME.log
      unpack_comfyui
      comfyui_run "${DOOR_NAME:-bench_door}" "${DOOR_LIMIT:-590}" python3 benchmarks/bench_comfyui_session.py \
        --dit "${DOOR_DIT:-fp8}" --samplers "${DOOR_SAMPLER:-ksampler}" --caps "${DOOR_CAPS:-none}" --cfgs "${DOOR_CFGS:-1,4}" \
        --limit "${DOOR_PROMPTS:-12}" --log-dir "$OUT" ${DOOR_ARGS:-} ;;
    loader-node)  # the loader node's load on the full-size ComfyUI files, fresh processes (ComfyUI's tokenizer from
      # .carry/comfyui); LOADER_NODE_ARGS="--pack-dirs . /path/old" alternates two packages
      unpack_comfyui
      run bench_loader_node "${LOADER_NODE_LIMIT:-300}" python3 benchmarks/bench_loader_node.py \
        --comfyui-dir /tmp/comfyui ${LOADER_NODE_ARGS:-} ;;
    comfyui-restart)  # the first images through ComfyUI, the files' load included: for each pack of RESTART_PACKS
      # (folders holding a pack, e.g. another release's git archive; default: this tree) a fresh machine (an empty
      # kernel cache of its own), then RESTART_ROUNDS (default 2) rounds of restarts on those caches, alternating the
      # packs; each server a process of its own, 3 prompts each
      unpack_comfyui
      packs=(${RESTART_PACKS:-$PWD})
      for round in fresh $(seq "${RESTART_ROUNDS:-2}"); do
        for i in "${!packs[@]}"; do
          name="comfyui_restart_${round}_${i}_$(basename "${packs[$i]}")"
          TRITON_CACHE_DIR=/tmp/tc_comfy_$i CUDA_CACHE_PATH=/tmp/tc_comfy_cuda_$i \
            comfyui_run "$name" "${RESTART_LIMIT:-150}" \
            python3 benchmarks/bench_comfyui_session.py --limit 3 --pack-dir "${packs[$i]}" --log-dir "$OUT/$name"
        done
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
grep -h '^{' "$OUT"/*.log > "$OUT/all.jsonl" 2>/dev/null || true
