"""Launch configurations come from the tuned table, else the kernel's rule; nothing is tuned unless asked, a failing
configuration falls back to the next, and the shipped tables only name configurations their kernels accept."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from qwen21_nodes.kernels import int8_gemm, launch_configs, quantize_rows
from qwen21_nodes.kernels.launch_configs import LaunchConfig, TunedKernel, key_text, m_bucket


class RecordingKernel:
    """Stands in for a @triton.jit function: records each `fn[grid](*args, **kwargs)` launch (a compile each, for
    a real kernel), and raises for the configurations listed in `fails`."""

    def __init__(self, fails=()):
        self.launches = []
        self.fails = set(fails)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            config = LaunchConfig.of(kwargs.pop("num_warps"), kwargs.pop("num_stages"),
                                     **{k: kwargs.pop(k) for k in ("BLOCK",)})  # fmt: skip
            if config in self.fails:
                raise type("OutOfResources", (Exception,), {})("out of resource: shared memory, Required: 300000")
            self.launches.append((grid, config, args, kwargs))

        return launch


def _kernel():
    return TunedKernel(
        "toy",
        ("M_BUCKET", "N"),
        rule=lambda key: LaunchConfig.of(4, 2, BLOCK=32),
        candidates=lambda key: [LaunchConfig.of(w, 3, BLOCK=b) for b in (16, 64) for w in (2, 8)],
    )


@pytest.fixture
def table(tmp_path, monkeypatch, use_settings):
    """A tuned table for a fake architecture, sm_99, holding one key of the toy kernel."""
    entries = {"toy": {key_text({"M_BUCKET": 256, "N": 512}): {"BLOCK": 64, "num_warps": 8, "num_stages": 3}}}
    (tmp_path / "sm_99.json").write_text(json.dumps({"arch": "sm_99", "kernels": entries}))
    monkeypatch.setattr(launch_configs, "TABLE_DIR", tmp_path)
    monkeypatch.setattr(launch_configs, "_tables", {})
    monkeypatch.setattr(launch_configs, "architecture", lambda device: "sm_99")
    use_settings(autotune=False)


def _launch(kernel, fn, key):
    return kernel.launch(
        fn, lambda config: (config.meta_dict()["BLOCK"],), ("x",), {"MODE": 1}, key, torch.device("cpu")
    )


def test_m_buckets_are_powers_of_two_capped():
    assert [m_bucket(m) for m in (1, 2, 3, 16, 17, 4096, 4097, 100000)] == [1, 2, 4, 16, 32, 4096, 8192, 16384]


def test_a_table_hit_launches_exactly_the_tuned_configuration(table):
    fn = RecordingKernel()
    ran = _launch(_kernel(), fn, {"M_BUCKET": 256, "N": 512})
    assert ran == LaunchConfig.of(8, 3, BLOCK=64)
    assert len(fn.launches) == 1  # one configuration compiled and run, no candidates timed
    grid, config, args, kwargs = fn.launches[0]
    assert grid == (64,) and args == ("x",) and kwargs == {"MODE": 1}


def test_a_missing_bucket_takes_the_nearest_tuned_bucket(table):
    fn = RecordingKernel()
    assert _launch(_kernel(), fn, {"M_BUCKET": 1024, "N": 512}) == LaunchConfig.of(8, 3, BLOCK=64)
    assert len(fn.launches) == 1


def test_a_missing_key_uses_the_rule_without_tuning_and_says_so(table, caplog):
    fn = RecordingKernel()
    with caplog.at_level(logging.INFO, logger=launch_configs.__name__):
        ran = _launch(_kernel(), fn, {"M_BUCKET": 256, "N": 999})
    assert ran == LaunchConfig.of(4, 2, BLOCK=32)
    assert len(fn.launches) == 1
    assert "from its rule" in caplog.text and "tune_kernels.py" in caplog.text


def test_no_table_for_the_architecture_uses_the_rule(table, monkeypatch):
    monkeypatch.setattr(launch_configs, "architecture", lambda device: "sm_12")
    fn = RecordingKernel()
    assert _launch(_kernel(), fn, {"M_BUCKET": 256, "N": 512}) == LaunchConfig.of(4, 2, BLOCK=32)


def test_a_configuration_that_fails_to_compile_falls_back_and_is_dropped(table, caplog):
    kernel = _kernel()
    tuned = LaunchConfig.of(8, 3, BLOCK=64)
    fn = RecordingKernel(fails={tuned})
    with caplog.at_level(logging.WARNING, logger=launch_configs.__name__):
        ran = _launch(kernel, fn, {"M_BUCKET": 256, "N": 512})
    assert ran == LaunchConfig.of(4, 2, BLOCK=32)  # the rule, next in line
    assert "failed on sm_99" in caplog.text
    fn.fails.clear()
    assert _launch(kernel, fn, {"M_BUCKET": 256, "N": 512}) == ran  # not retried in this process


def test_every_candidate_failing_raises(table):
    kernel = _kernel()
    everything = {kernel.rule({}), *kernel.candidates({}), LaunchConfig.of(8, 3, BLOCK=64)}
    with pytest.raises(RuntimeError, match="no launch configuration compiles"):
        _launch(kernel, RecordingKernel(fails=everything), {"M_BUCKET": 256, "N": 512})


def test_a_launch_error_that_is_not_about_resources_is_not_swallowed(table):
    class Broken(RecordingKernel):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise ValueError("wrong argument")

            return launch

    with pytest.raises(ValueError, match="wrong argument"):
        _launch(_kernel(), Broken(), {"M_BUCKET": 256, "N": 512})


def test_autotuning_only_when_asked_and_cached_on_disk(table, monkeypatch, use_settings):
    made, launched = [], []

    class FakeTuner:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid({"BLOCK": 16, "num_warps": 2}), args, kwargs))

    def fake_autotune(configs, key, cache_results=False):  # Triton's signature, as far as we use it
        made.append((len(configs), tuple(key), cache_results))
        return lambda fn: FakeTuner()

    monkeypatch.setattr(launch_configs.triton, "autotune", fake_autotune)
    fn = RecordingKernel()
    _launch(_kernel(), fn, {"M_BUCKET": 256, "N": 512})
    assert made == [] and len(fn.launches) == 1  # the table served
    use_settings(autotune=True)
    _launch(_kernel(), fn, {"M_BUCKET": 256, "N": 512})
    assert made == [(4, ("M_BUCKET", "N"), True)]  # every candidate, the kernel's key, results kept on disk
    assert launched == [((16,), ("x",), {"MODE": 1})] and len(fn.launches) == 1


@pytest.mark.parametrize("kernel", [int8_gemm.TUNED, quantize_rows.TUNED], ids=lambda k: k.name)
def test_shipped_tables_name_valid_keys_and_configurations(kernel):
    """Every shipped table entry has the kernel's key fields, and a configuration of the kernel's own parameters
    (a typo would otherwise only show up on a GPU of that architecture)."""
    tables = sorted(launch_configs.TABLE_DIR.glob("sm_*.json"))
    for path in tables:
        entries = json.loads(path.read_text())["kernels"].get(kernel.name, {})
        for text, config in entries.items():
            names = [part.split("=")[0] for part in text.split(",")]
            assert tuple(names) == kernel.key_names, (path.name, text)
            key = {part.split("=")[0]: int(part.split("=")[1]) for part in text.split(",")}
            params = {name for candidate in kernel.candidates(key) for name, _ in candidate.meta}
            assert set(LaunchConfig.from_json(config).meta_dict()) == params, (path.name, text, config)


def test_rules_fit_every_card_the_kernels_support():
    """The int8 rule stays within 48 KiB of shared memory (SM 7.5's default limit); the quantiser's rule keeps
    8 to 128 values per thread for every row width the kernel takes whole."""
    for bucket in (1, 16, 64, 128, 16384):
        meta = dict(int8_gemm._rule({"M_BUCKET": bucket}).meta)
        config = int8_gemm._rule({"M_BUCKET": bucket})
        stage_bytes = (meta["BLOCK_M"] + meta["BLOCK_N"]) * meta["BLOCK_K"]
        assert stage_bytes * config.num_stages <= 48 * 1024
    for k in (64, 256, 3072, 4096, 12288):
        config = quantize_rows._rule({"K": k, "ROTATE": False})
        block_k = quantize_rows._block_k({"K": k, "ROTATE": False})
        assert quantize_rows._fits(config.meta_dict()["BLOCK_M"], config.num_warps, block_k), k
