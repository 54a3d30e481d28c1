"""The startup checks read the language model's fields wherever the checkpoint keeps them
(top level, ``text_config``, or InternVL's ``llm_config``), and name the attention backend that
forces pages rather than a ``--page-size`` nobody typed."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_unicache.engine.support import unsupported_model, unsupported_setup

INTERNVL = {"architectures": ["InternVLChatModel"],
            "llm_config": {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
                           "num_key_value_heads": 2}}


def args(**overrides):
    return SimpleNamespace(**{"page_size": None, "tp_size": 1, **overrides})


def test_internvl_is_served():
    assert unsupported_setup(args(), INTERNVL) is None


def test_internvl_language_model_fields_are_checked():
    sliding = {**INTERNVL, "llm_config": {**INTERNVL["llm_config"], "use_sliding_window": True}}
    assert "hybrid models" in unsupported_model(sliding)
    assert "--tp-size 4 does not divide the model's 2 KV heads" in \
        unsupported_setup(args(tp_size=4), INTERNVL)


def test_a_paged_backend_is_named():
    for name in ("attention_backend", "decode_attention_backend"):
        reason = unsupported_setup(args(**{name: "trtllm_mha", "page_size": 64}), INTERNVL)
        assert reason.startswith("--attention-backend trtllm_mha is not supported with "
                                 "--unicache (its Blackwell kernels read the KV pool heads-first")
    assert unsupported_setup(args(page_size=16), INTERNVL) is None  # paged KV is served
