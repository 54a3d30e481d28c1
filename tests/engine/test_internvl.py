"""InternVL (``InternVLChatModel``: InternViT tower, pixel shuffle, Qwen2 language model with 1-D
RoPE) served with ``--unicache`` on the CPU platform, from a tiny random checkpoint built here:
keep 1.0 answers as stock SGLang does; keep 0.1 compresses each image, a later question is served
from the cache without encoding the image again, a two-image request compresses both, each
image one span over all of its tiles, and an agent loop encodes and compresses each new
screenshot once."""

from __future__ import annotations

import pytest

from tests.conftest import assert_integrity
from tests.support.agent import assert_each_screenshot_encoded_and_compressed_once
from tests.support.client import answer, chat, flush_cache, internal_state
from tests.support.images import data_url, image_chat, solid_png
from tests.support.server import start_server
from tests.support.tiny_internvl import build_tiny_internvl

IMAGE_TOKENS = 64  # one 448 px tile (max_dynamic_patch 1)
KEPT = 6  # keep 0.1 of a 64-token image
# Without max_dynamic_patch SGLang's processor cuts a square image into 3 x 3 tiles plus a
# thumbnail: 640 tokens, one span.
TILED_TOKENS = 10 * IMAGE_TOKENS
CHATS = [((200, 30, 30), "what colour is it?"), ((30, 200, 30), "describe the picture"),
         ((30, 30, 200), "is there a square?")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_internvl(tmp_path_factory.mktemp("models") / "tiny-internvl")


def one_tile(png: bytes, question: str, **params) -> dict:
    """A chat body whose image SGLang's InternVL processor keeps as one tile."""
    body = image_chat(png, question, **params)
    body["messages"][0]["content"][0]["image_url"]["max_dynamic_patch"] = 1
    return body


def answers(server) -> list[str]:
    return [answer(chat(server, one_tile(solid_png(colour), question, max_tokens=8)))
            for colour, question in CHATS]


def unicache(server) -> dict:
    return internal_state(server)["unicache"]


def test_keep_one_answers_as_stock(serve):
    stock, identity = serve.all((), ("--unicache", "--unicache-keep-ratio", "1.0"))
    assert answers(identity) == answers(stock)


def test_keep_a_tenth_compresses_reuses_and_takes_two_images(serve, nocheck_config, tmp_path):
    server = serve("--unicache", "--unicache-keep-ratio", "0.1", "--unicache-config",
                   nocheck_config)
    flush_cache(server)
    png = solid_png((140, 30, 200))
    before = unicache(server)
    out = chat(server, one_tile(png, "what colour is it?", max_tokens=4))
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == IMAGE_TOKENS
    first = unicache(server)
    assert first["images_compressed"] - before["images_compressed"] == 1
    assert first["slots_freed"] - before["slots_freed"] == IMAGE_TOKENS - KEPT
    later = chat(server, one_tile(png, "where is the square?", max_tokens=4))
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    second = unicache(server)
    assert (second["spans_recalled"] + second["spans_reused"]
            - first["spans_recalled"] - first["spans_reused"]) == 1
    assert second["images_prefilled"] == first["images_prefilled"]  # not encoded again
    body = image_chat(solid_png((10, 120, 10)), "compare them", max_tokens=4)
    body["messages"][0]["content"].insert(
        0, {"type": "image_url", "image_url": {"url": data_url(solid_png((250, 250, 0)))}})
    out = chat(server, body)
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == 2 * TILED_TOKENS
    third = unicache(server)
    assert third["images_compressed"] - second["images_compressed"] == 2
    assert third["slots_freed"] - second["slots_freed"] == 2 * (TILED_TOKENS - TILED_TOKENS // 10)
    colours = [(60 * i, 240 - 60 * i, 90) for i in range(3)]
    assert_each_screenshot_encoded_and_compressed_once(
        server, [solid_png(c) for c in colours], tmp_path, {"max_dynamic_patch": 1})
    assert_integrity(server)


# -- compressed decoding against an independent reference ----------------------------------------

KEEP = 0.25
NEW_TOKENS = 10
WARM = "what colour is it?"  # the question that compresses an image before it is reused


def _vision_features(weights: dict, config: dict, png: bytes):
    """SGLang's InternVL image path re-done in plain torch (float32): one 448 px tile as its
    processor cuts it (bicubic, bfloat16 pixels), InternViT, pixel shuffle (v2) and ``mlp1``."""
    import io

    import numpy as np
    import torch
    import torch.nn.functional as F
    from PIL import Image

    from tests.support.tiny_internvl import TILE

    vit = config["vision_config"]
    image = np.array(Image.open(io.BytesIO(png)).convert("RGB"))
    pixels = torch.from_numpy(image).permute(2, 0, 1).float() / 255.0
    mean = torch.tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    pixels = F.interpolate(((pixels - mean) / std)[None], size=(TILE, TILE), mode="bicubic",
                           align_corners=False)
    pixels = pixels.to(torch.bfloat16).float()

    def w(name):
        return weights[name].float()

    p = "vision_model.embeddings."
    x = F.conv2d(pixels, w(p + "patch_embedding.weight"), w(p + "patch_embedding.bias"),
                 stride=vit["patch_size"])
    side = x.shape[-1]
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([w(p + "class_embedding"), x], dim=1) + w(p + "position_embedding")
    d, heads = vit["hidden_size"], vit["num_attention_heads"]
    for i in range(vit["num_hidden_layers"]):
        p = f"vision_model.encoder.layers.{i}."
        h = F.layer_norm(x, (d,), w(p + "norm1.weight"), w(p + "norm1.bias"),
                         vit["layer_norm_eps"])
        q, k, v = F.linear(h, w(p + "attn.qkv.weight"), w(p + "attn.qkv.bias")).chunk(3, -1)
        q, k, v = (t.view(1, -1, heads, d // heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, -1, d)
        x = x + F.linear(a, w(p + "attn.proj.weight"), w(p + "attn.proj.bias")) * w(p + "ls1")
        h = F.layer_norm(x, (d,), w(p + "norm2.weight"), w(p + "norm2.bias"),
                         vit["layer_norm_eps"])
        h = F.linear(F.gelu(F.linear(h, w(p + "mlp.fc1.weight"), w(p + "mlp.fc1.bias"))),
                     w(p + "mlp.fc2.weight"), w(p + "mlp.fc2.bias"))
        x = x + h * w(p + "ls2")
    x = x[:, 1:].reshape(1, side, side, d)
    # pixel_shuffle(scale 0.5), ps_version v2
    x = x.view(1, side, side // 2, d * 2).permute(0, 2, 1, 3).contiguous()
    x = x.view(1, side // 2, side // 2, d * 4).permute(0, 2, 1, 3).contiguous()
    x = x.reshape(1, -1, d * 4)
    x = F.layer_norm(x, (d * 4,), w("mlp1.0.weight"), w("mlp1.0.bias"))
    x = F.linear(F.gelu(F.linear(x, w("mlp1.1.weight"), w("mlp1.1.bias"))),
                 w("mlp1.3.weight"), w("mlp1.3.bias"))
    return x[0]


class _Reference:
    """The checkpoint's Qwen2 language model in transformers, with image features placed on the
    ``<IMG_CONTEXT>`` rows: what ``greedy_with_pruned_cache`` calls as a (1-D RoPE) model."""

    def __init__(self, model_dir):
        import json
        from pathlib import Path

        import torch
        from safetensors.torch import load_file
        from transformers import Qwen2Config, Qwen2ForCausalLM

        self.config_json = json.loads((Path(model_dir) / "config.json").read_text())
        self.weights = load_file(Path(model_dir) / "model.safetensors")
        llm = dict(self.config_json["llm_config"])
        self.lm = Qwen2ForCausalLM(Qwen2Config(**llm)).to(torch.float32).eval()
        prefix = "language_model."
        state = {k[len(prefix):]: v.float() for k, v in self.weights.items()
                 if k.startswith(prefix)}
        self.lm.load_state_dict(state, strict=True)
        self.model = self.lm.model  # 1-D positions (no get_rope_index)
        self.context_id = None

    def __call__(self, input_ids, image_features=None, **kwargs):
        embeds = self.lm.model.embed_tokens(input_ids)
        if image_features is not None:
            rows = input_ids[0] == self.context_id
            embeds = embeds.clone()
            embeds[0, rows] = image_features[: int(rows.sum())]
        return self.lm(inputs_embeds=embeds, **kwargs)


@pytest.fixture(scope="module")
def random_server(model, server_factory, nocheck_config):
    server_factory.make_room(1, hold=True)
    from tests.conftest import LOG_DIR

    server = start_server(model, [
        "--unicache", "--unicache-method", "random", "--unicache-keep-ratio", str(KEEP),
        "--unicache-config", nocheck_config, "--dtype", "float32", "--enable-cache-report"],
        LOG_DIR / "server-internvl-random.log")
    yield server
    server.stop()
    server_factory.release(1)


def _reference_case(reference, server, png, question, **params):
    """The served reply to a one-tile request and the reference inputs for its prompt ids."""
    import torch

    body = one_tile(png, question, max_tokens=NEW_TOKENS, **params)
    body["return_input_ids_in_sglext"] = True
    out = chat(server, body)
    ids = torch.tensor([out["sglext"]["input_ids"]])
    return out, {"input_ids": ids, "image_features": _vision_features(
        reference.weights, reference.config_json, png)}


def _selection(reference, inputs, span):
    from sglang_unicache.policy.config import UniCacheConfig
    from tests.engine.test_reference import kept_entries

    llm = reference.config_json["llm_config"]
    config = UniCacheConfig(method="random", keep_ratio=KEEP, selfcheck=False)
    return kept_entries(config, llm["num_hidden_layers"], inputs["input_ids"].shape[1],
                        llm["num_key_value_heads"],
                        llm["hidden_size"] // llm["num_attention_heads"], span)


@pytest.fixture(scope="module")
def reference(model):
    from transformers import AutoTokenizer

    ref = _Reference(model)
    ref.tokenizer = AutoTokenizer.from_pretrained(model)
    ref.context_id = ref.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    return ref


def test_internvl_decodes_on_its_compressed_image_like_the_reference(random_server, reference):
    from tests.support.reference import greedy_with_pruned_cache, image_span

    differs_from_full = positions_matter = False
    for colour, question in CHATS:
        png = solid_png(colour)
        before = unicache(random_server)
        out, inputs = _reference_case(reference, random_server, png, question)
        after = unicache(random_server)
        span = image_span(inputs, reference.context_id)
        assert span[1] - span[0] == IMAGE_TOKENS
        kept = _selection(reference, inputs, span)
        removed = span[1] - span[0] - kept[0].shape[1]
        assert after["images_compressed"] == before["images_compressed"] + 1
        assert after["slots_freed"] - before["slots_freed"] == removed
        expected = greedy_with_pruned_cache(reference, inputs, span, kept, NEW_TOKENS)
        full = greedy_with_pruned_cache(reference, inputs, span, None, NEW_TOKENS)
        # Without the plugin's offset, decode would run at the compacted row's positions.
        unshifted = greedy_with_pruned_cache(reference, inputs, span, kept, NEW_TOKENS,
                                             shift=-removed)
        differs_from_full |= expected != full
        positions_matter |= unshifted != expected
        assert answer(out) == reference.tokenizer.decode(expected, skip_special_tokens=True), (
            colour, question)
    assert differs_from_full, "compression changed no output: the comparison proves nothing"
    assert positions_matter, "positions changed no output: the comparison proves nothing"


def test_internvl_reuses_the_span_at_the_right_positions(random_server, reference):
    from tests.support.reference import greedy_with_pruned_cache, image_span

    positions_matter = False
    for colour, question in [((90, 10, 160), "where is the square?"),
                             ((10, 200, 90), "describe the picture"),
                             ((250, 250, 250), "is there a circle?")]:
        png = solid_png(colour)
        _, warm = _reference_case(reference, random_server, png, WARM)
        reused_before = unicache(random_server)["spans_reused"]
        out, inputs = _reference_case(reference, random_server, png, question)
        assert unicache(random_server)["spans_reused"] == reused_before + 1
        span = image_span(inputs, reference.context_id)
        assert image_span(warm, reference.context_id) == span
        # The span was selected when the first request (WARM) compressed it.
        kept = _selection(reference, warm, span)
        removed = (span[1] - span[0]) - kept[0].shape[1]
        shared = out["usage"]["prompt_tokens_details"]["cached_tokens"]  # original units
        assert shared > span[1], "the request did not reuse the cached span"
        expected = greedy_with_pruned_cache(reference, inputs, span, kept, NEW_TOKENS,
                                            prune_at=shared)
        unshifted = greedy_with_pruned_cache(reference, inputs, span, kept, NEW_TOKENS,
                                             prune_at=shared, shift=-removed)
        assert answer(out) == reference.tokenizer.decode(expected, skip_special_tokens=True)
        positions_matter |= expected != unshifted
    assert positions_matter, "positions changed no output: the comparison proves nothing"
