"""Our engine behind ComfyUI's own types, in a real ComfyUI (0.3.64 runs on a CPU): KSampler and the custom
sampling nodes drive our MODEL, ComfyUI's conditioning and LoRA nodes work on our CONDITIONING and MODEL, and our VAE
is a ComfyUI VAE. One child process in ComfyUI's Python runs every check (tests/comfyui_child.py); each test here
asserts on one check's measurements. Skipped, saying why, without COMFYUI_DIR."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMFYUI_DIR = os.environ.get("COMFYUI_DIR", "")
CHILD = Path(__file__).with_name("comfyui_child.py")
CHECKS = ("parity", "native_layout", "ksampler_matrix", "simple_schedule", "lora_fp32", "lora_fp8", "lora_int8",
          "lora_int8_convrot", "lora_stack", "conditioning_nodes", "vae", "bad_inputs", "sdxl_lora",
          "object_patch_leak", "negative_left_alone", "empty_latents", "unet_patches", "alpha_not_rank",
          "conditioning_combine", "gguf_model", "model_type_line", "control", "native_control")  # fmt: skip

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(not (COMFYUI_DIR and os.path.isfile(os.path.join(COMFYUI_DIR, "main.py"))),
                       reason="set COMFYUI_DIR to a ComfyUI checkout (and COMFYUI_PYTHON to its interpreter) to drive "
                              "our MODEL with ComfyUI's own nodes"),  # fmt: skip
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import qwen21_nodes

    scratch = tmp_path_factory.mktemp("comfyui_types")
    packages = scratch / "packages"
    packages.mkdir()
    (packages / "qwen21_nodes").symlink_to(Path(qwen21_nodes.__file__).parent)
    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    env = {**os.environ, "PYTHONPATH": str(packages), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([python, "-P", str(CHILD), COMFYUI_DIR, str(scratch), ",".join(CHECKS)], env=env,
                          capture_output=True, text=True, timeout=1500)  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    found = {line["check"]: line for line in lines}
    assert done.returncode == 0 and set(found) == set(CHECKS), done.stdout[-3000:] + done.stderr[-5000:]
    return found


def result(results, name):
    line = results[name]
    assert "failed" not in line, line["failed"]
    return line


def test_samplercustomadvanced_with_our_sigmas_gives_qwen21_samplers_latent(results):
    line = result(results, "parity")
    assert line["cfg1"] <= 1e-4 and line["cfg4"] <= 1e-4
    assert line["cfg1_prefills"] == 1 and line["cfg4_prefills"] == 2  # one prefix per conditioning, not per step


def test_a_conditioning_in_native_layout_gives_the_same_latent(results):
    line = result(results, "native_layout")
    assert line["relative"] <= 1e-5 and line["references"] == 1 and len(line["slots"]) == 1


def test_ksampler_runs_every_listed_sampler_and_scheduler(results):
    line = result(results, "ksampler_matrix")
    assert len(line["results"]) == 13 and all(line["results"].values()), line["results"]
    assert line["shape"][1] == 64
    assert line["wide_latent"] == [2, 64, 4, 6] and line["wide_image"] == [2, 64, 96, 3]  # Qwen21 Empty Latent


def test_ksamplers_simple_schedule_is_the_released_one_at_1024_but_its_terminal_stretch(results):
    line = result(results, "simple_schedule")
    assert 0 < line["max_abs"] < 0.05  # the released schedule stretches its end to 0.02 (help: Qwen21Scheduler)


@pytest.mark.parametrize("weight_dtype", ["fp32", "fp8", "int8", "int8_convrot"])
def test_comfyuis_lora_loader_lands_in_our_merge(results, weight_dtype):
    line = result(results, f"lora_{weight_dtype}")
    assert line["patches"] > 0 and line["keys_not_loaded"] == 0
    assert line["effect"] > 1e-3  # the LoRA changes the latent
    assert line["difference"] <= 1e-3 * line["effect"]  # the same merge, whichever loader put it on
    assert line["plain_again"] == 0  # the plain MODEL is plain again, bit for bit (the merge restores exactly)
    if weight_dtype == "fp32":  # and KSampler's loop equals ours where the math is exact
        assert line["our_loop"] <= 1e-4


def test_comfyuis_conditioning_nodes_work_on_ours(results):
    line = result(results, "conditioning_nodes")
    assert line["finite"] and line["zero_out_changes"] > 1e-4
    assert line["split_range_vs_whole"] <= 1e-5  # the same prompt over two timestep ranges = the prompt
    assert line["average_of_same"] <= 1e-5


def test_our_vae_is_a_comfyui_vae(results):
    line = result(results, "vae")
    assert line["channels"] == 3 and line["rgb"] == 0  # ComfyUI's IMAGE is RGB; Qwen21 VAE Decode gives the alpha
    assert line["tiled_finite"] and line["tiled_shape"][-1] == 3
    assert line["encode"] <= 1e-5


def test_bad_input_is_named_and_the_next_run_works(results):
    line = result(results, "bad_inputs")
    errors = line["errors"]
    assert "pooled output" in errors["sdxl_conditioning"] and "pooled output" in errors["t5_conditioning"]
    assert "from another model's text encoder" in errors["wrong_width"]
    assert "Qwen-Image-2.1 latents are [B, 64" in errors["four_channel_latent"]
    assert "cannot apply to our DiT" in errors["attention_patch"] and "attn1_patch" in errors["attention_patch"]
    assert line["after_finite"]


def test_a_lora_for_another_model_is_named_key_by_key_and_refused_at_its_loader(results):
    line = result(results, "sdxl_lora")
    assert len(line["keys_not_loaded"]) == 2  # ComfyUI names each key
    assert line["error"].startswith("LoraError:") and "matches no layer of Qwen-Image-2.1" in line["error"]


def test_stacked_comfyui_loras_and_a_changed_strength_land_as_our_chain_does(results):
    line = result(results, "lora_stack")
    for case in ("0.7+0.4", "0.7+-0.2"):
        assert line[case]["effect"] > 1e-3 and line[case]["difference"] <= 1e-6 * max(1.0, line[case]["effect"])
    assert line["plain_again"] == 0


def test_an_object_patch_on_one_clone_never_reaches_another(results):
    line = result(results, "object_patch_leak")
    assert line["patched_effect"] > 1e-4  # the shift changed the clone's image
    assert line["plain_again"] == 0  # and the plain MODEL, run after it, gives its own latent bit for bit


def test_the_negative_is_encoded_only_where_the_guidance_uses_it(results):
    line = result(results, "negative_left_alone")
    assert line["encodes_at_cfg1"] == 0 and line["pending_after_cfg1"]
    assert line["encodes_after_cfg4_twice"] == 1  # once per conditioning, whatever the runs
    assert line["finite"]  # cfg below 1 is ComfyUI's business: it runs


def test_comfyuis_empty_latents_give_the_size_asked_for_or_a_named_error(results):
    line = result(results, "empty_latents")
    for node in ("EmptyLatentImage", "EmptySD3LatentImage"):
        assert line["sizes"][f"{node}/256x256"] == [1, 256, 256, 3]
        assert line["sizes"][f"{node}/256x160"] == [1, 160, 256, 3]
        error = line["errors"][f"{node}/200x136"]
        assert error.startswith("EmptyLatentSizeError") and "200x136 px" in error and "208x144" in error


def test_a_unet_patch_is_refused_by_name(results):
    line = result(results, "unet_patches")
    assert line["is_key_error"] and "FreeU" in line["error"] and "'model_channels'" in line["error"]
    assert line["after_finite"]


def test_a_lora_whose_alpha_is_not_its_rank_lands_scaled_through_both_loaders(results):
    line = result(results, "alpha_not_rank")
    assert line["comfy"] <= 1e-5 and line["ours"] <= 1e-5  # relative to the LoRA's own change of the weight
    assert line["plain_again"] == 0


def test_two_combined_prompts_through_ksampler_match_our_math_per_prompt(results):
    line = result(results, "conditioning_combine")
    for cfg in ("cfg1", "cfg4"):
        assert line[cfg]["relative"] <= 1e-5, line
        assert line[cfg]["effect"] > 1e-4  # the second prompt matters: sharing one branch would show


def test_a_gguf_dit_behind_comfyuis_model_samples_and_takes_comfyuis_lora_beside_its_blocks(results):
    line = result(results, "gguf_model")
    assert line["layers"] == 8 and line["types"] == ["Q8_0"]
    assert line["relative"] <= 1e-4  # KSampler's loop on the GGUF MODEL = Qwen21 Sampler's (fp32 compute)
    assert line["lora_effect"] > 1e-3 and line["blocks_untouched"] and line["plain_again"] == 0
    assert line["required_extra"] == line["largest_weight"] > 0  # memory_required holds one dequantised layer


def test_the_log_says_which_model_is_loaded_after_comfyuis_model_type_line(results):
    after = result(results, "model_type_line")["after"]
    assert any(line.startswith("Qwen21 MODEL: Qwen-Image-2.1") and "no FLUX model" in line for line in after), after


def test_fun_control_through_comfyuis_samplers_matches_qwen21_sampler(results):
    line = result(results, "control")
    assert line["parity"] <= 1e-4 and line["apply_model_output"] <= 1e-4
    assert line["effect"] > 1e-2  # the control and inpainting change the latent: the parity above can fail
    assert line["half_to_full"] > 1e-4 and line["half_to_plain"] > 1e-4  # half the steps controlled: in between
    assert line["off_to_plain"] == 0.0  # strength 0 is the plain model
    assert line["status_control"] == "3/3 calls at strength 1"  # the run says how many calls ran controlled
    # what ComfyUI's own sampler asks load_models_gpu for, one load of the DiT per run: the branch's caches and
    # activations counted; a range inside the schedule keeps a plain branch beside the controlled one; strength 0
    # is the plain model
    memory = line["memory"]
    assert all(len(asked) == 1 for asked in memory.values()), memory
    assert memory["off"] == memory["plain"] and memory["plain"][0] < memory["control"][0] < memory["both_sides"][0]


def test_native_fun_controlnet_nodes_patches_run_as_our_control(results):
    """Native ComfyUI's QwenImage21FunControlNetApply (a stand-in with its layout: its hooks only count calls) on our
    MODEL gives what Qwen21 Apply Fun Control (MODEL) gives with the same images, strength and range."""
    line = result(results, "native_control")
    assert line["parity"] <= 1e-6 and line["again"] == 0.0
    assert line["effect"] > 1e-2
    assert line["native_hooks_called"] == 0
    memory = line["memory"]  # what ComfyUI's sampler asked room for: the branch counted, native's as ours
    assert memory["plain"][0] < memory["native"][0] == memory["ours"][0], memory
