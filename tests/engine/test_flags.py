"""Every bad ``--unicache*`` value and unsupported setup fails at startup with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_unicache.policy.registry import known_methods
from tests.support.server import cpu_env


@pytest.fixture(scope="module")
def prepare(tiny_model):
    """SGLang's own argv -> ServerArgs path, with the plugin's hooks applied."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    def run(*argv: str, model=None):
        return prepare_server_args(["--model-path", str(model or tiny_model), *argv])

    return run


def error_of(prepare, *argv, model=None) -> str:
    with pytest.raises(SystemExit) as info:
        prepare(*argv, model=model)
    message = str(info.value.code)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("argv, expected", [
    (["--unicache-keep-ratio", "0"], "--unicache-keep-ratio: unicache config: keep_ratio must be "
                                     "in (0, 1], got 0.0"),
    (["--unicache-keep-ratio", "1.5"], "keep_ratio must be in (0, 1], got 1.5"),
    (["--unicache-keep-ratio", "a"], "--unicache-keep-ratio: expected a number, got 'a'"),
    (["--unicache-method", "lru"], "--unicache-method: unicache config: method must be one of "
                                   f"{', '.join(known_methods())}; got 'lru'"),
    (["--unicache-min-image-tokens", "-3"], "--unicache-min-image-tokens: "),
    (["--unicache-config", "/nonexistent/u.json"], "--unicache-config: cannot read"),
    # SGLang pages the KV for this backend after parsing: the line names the backend, not a
    # --page-size nobody typed
    (["--attention-backend", "trtllm_mha"],
     "--attention-backend trtllm_mha is not supported with --unicache (its Blackwell kernels"),
    (["--speculative-algorithm", "NGRAM"], "speculative decoding is not supported"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
     "--hicache-storage-backend file: HiCache storage backends are not supported"),
    (["--enable-hierarchical-cache", "--hicache-write-policy", "write_back"],
     "--hicache-write-policy write_back: not supported with --unicache"),
    (["--disaggregation-mode", "prefill"], "PD disaggregation is not supported"),
    (["--kv-cache-dtype", "nvfp4"], "separate scale buffers"),
    (["--pp-size", "2"], "--pp-size 2: pipeline parallel stages cannot agree on one"),
    (["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"],
     "--enable-dp-attention: data-parallel attention is not supported"),
    (["--attn-dp-size", "2", "--tp-size", "2"],
     "--attn-dp-size 2: data-parallel attention is not supported"),
    (["--attn-cp-size", "2", "--tp-size", "2"], "--attn-cp-size 2: context parallel attention"),
    (["--dcp-size", "2", "--tp-size", "2"], "--dcp-size 2: context parallel attention"),
    (["--enable-pdmux"], "--enable-pdmux: not supported with --unicache"),
    (["--enable-two-batch-overlap"], "--enable-two-batch-overlap: not supported with --unicache"),
    (["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill full: a prefill"),
    # the tiny model has 2 KV heads: 4 ranks would replicate them
    (["--tp-size", "4"], "--tp-size 4 does not divide the model's 2 KV heads"),
    (["--enable-mixed-chunk"], "--enable-mixed-chunk: mixed prefill/decode batches are not"),
])
def test_bad_flag_fails_with_one_line(prepare, argv, expected):
    assert expected in error_of(prepare, "--unicache", *argv)


def test_unknown_and_bad_config_keys(prepare, tmp_path):
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"keep_ratio": 0.2, "beam_width": 3}))
    assert "unknown unicache config key 'beam_width'" in error_of(
        prepare, "--unicache", "--unicache-config", str(unknown))
    bad = tmp_path / "bad.yaml"
    bad.write_text("selfcheck_threshold: -1\n")
    assert "--unicache-config" in error_of(prepare, "--unicache", "--unicache-config", str(bad))


def test_config_file_and_flags_compose(prepare, tmp_path):
    from sglang_unicache.engine.flags import config_of

    path = tmp_path / "u.yaml"
    path.write_text("method: snapkv\nkeep_ratio: 0.3\nobservation_window: 8\n")
    args = prepare("--unicache", "--unicache-config", str(path), "--unicache-keep-ratio", "0.05")
    config = config_of(args)
    assert (config.method, config.keep_ratio, config.observation_window) == ("snapkv", 0.05, 8)
    assert config_of(prepare()) is None, "flags without --unicache must not enable compression"


@pytest.mark.parametrize("patch, expected", [
    ({"kv_lora_rank": 512}, "MLA/DSA models are not supported"),
    ({"use_sliding_window": True}, "hybrid models"),
    ({"architectures": ["MistralForCausalLM"]}, "model architecture MistralForCausalLM is not "
                                                "supported"),
])
def test_unsupported_models_fail(prepare, tiny_model, tmp_path, patch, expected):
    config = json.loads((tiny_model / "config.json").read_text())
    config.update(patch)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert expected in error_of(prepare, "--unicache", model=tmp_path)


def test_launch_server_prints_one_line_and_exits(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_model),
         "--unicache", "--unicache-keep-ratio", "0"],
        capture_output=True, text=True, timeout=120, env=cpu_env(),
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --unicache-keep-ratio: unicache config: keep_ratio must be in "
                      "(0, 1], got 0.0"]
    assert "Traceback" not in proc.stderr


def test_host_quantization_needs_hicache_and_float_kv(prepare, tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text("host_quantization: int8\n")
    assert "host_quantization int8: needs --enable-hierarchical-cache" in error_of(
        prepare, "--unicache", "--unicache-config", str(path))
    assert "not with --kv-cache-dtype fp8_e4m3" in error_of(
        prepare, "--unicache", "--unicache-config", str(path), "--enable-hierarchical-cache",
        "--kv-cache-dtype", "fp8_e4m3")
    prepare("--unicache", "--unicache-config", str(path), "--enable-hierarchical-cache")
