"""The real SGLang engine on CPU with the plugin loaded: HTTP, Engine, frontend, pool cap.

(Cached tokens for a repeated image: ``test_compression.py``.)
"""

from __future__ import annotations

import requests

from tests.support.images import image_chat, solid_png

IMAGE_TOKENS = 64  # 224 px image, 14 px patches, 2x2 merge


def chat(server, body):
    response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_completion_with_png_returns_tokens(unicache_server):
    out = chat(unicache_server, image_chat(solid_png((10, 200, 30)), "what colour is it?"))
    usage = out["usage"]
    assert usage["completion_tokens"] > 0
    assert usage["prompt_tokens_details"]["image_tokens"] == IMAGE_TOKENS
    assert usage["prompt_tokens"] > IMAGE_TOKENS


def test_scheduler_process_receives_the_flags(unicache_server):
    log = unicache_server.log()
    assert "scheduler received config method=unicache keep_ratio=0.25" in log


def test_platform_caps_the_kv_pool(unicache_server):
    info = requests.get(f"{unicache_server.url}/server_info", timeout=10).json()
    assert info["max_total_num_tokens"] == 32768


def test_offline_engine_with_image_data(engine, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "what colour?"}]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    path = tmp_path / "img.png"
    path.write_bytes(solid_png((30, 30, 220)))
    out = engine.generate(prompt=prompt, image_data=str(path),
                          sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 6
    assert out["meta_info"]["prompt_tokens"] > IMAGE_TOKENS


def test_frontend_program_with_sgl_image(unicache_server, tmp_path):
    import sglang as sgl

    path = tmp_path / "img.png"
    path.write_bytes(solid_png((200, 30, 200)))

    @sgl.function
    def ask(s, image_path, question):
        s += sgl.user(sgl.image(image_path) + question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))

    backend = sgl.RuntimeEndpoint(unicache_server.url)
    state = ask.run(image_path=str(path), question="what colour?", backend=backend)
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] > IMAGE_TOKENS, "the image did not reach the model"
