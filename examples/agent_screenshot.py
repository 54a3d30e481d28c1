"""An agent loop with the OpenAI client: a new screenshot at every step, earlier ones kept.

    python examples/agent_screenshot.py --url http://127.0.0.1:30000 --images s1.png s2.png s3.png

Each step sends the whole history, as agent frameworks do: every earlier step's screenshot, its
instruction and the agent's reply, then the new screenshot and the next instruction. With
``--unicache`` the server compresses each screenshot once, after the prefill that first sees it,
and every later step reuses the compressed copies of the earlier screenshots from the radix tree
(no encoding, no prefill, K slots each) while it compresses the new one. The script prints, per
step, the tokens the server took from its cache and, when the server runs the plugin, what it
compressed and reused so far.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import requests
from openai import OpenAI

STEPS = ["What is on the screen?", "Which button should be clicked next?", "Describe the page.",
         "Is a dialog open?", "Where is the search field?", "Is the task done?"]


def _screenshot(path: str, image_fields: dict | None = None) -> dict:
    url = "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": url, **(image_fields or {})}}


def plugin_stats(url: str) -> dict:
    """The plugin's counters from ``/server_info`` (empty without ``--unicache``)."""
    info = requests.get(f"{url}/server_info", timeout=30).json()
    return info["internal_states"][0].get("unicache", {})


def run(url: str, screenshots: list[str], steps: list[str] = STEPS,
        max_tokens: int = 16, image_fields: dict | None = None) -> list[dict]:
    """One step per screenshot (instructions cycle through ``steps``); a log entry per step.
    ``image_fields`` go into every screenshot's ``image_url`` (SGLang reads some there, e.g.
    InternVL's ``max_dynamic_patch``)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    history: list[dict] = [{"role": "system", "content": "You are a helpful screen agent."}]
    log = []
    for i, path in enumerate(screenshots):
        step = steps[i % len(steps)]
        history.append({"role": "user", "content": [_screenshot(path, image_fields),
                                                    {"type": "text", "text": step}]})
        reply = client.chat.completions.create(model="default", messages=history,
                                               temperature=0, max_tokens=max_tokens)
        text = reply.choices[0].message.content
        history.append({"role": "assistant", "content": text})
        details = reply.usage.prompt_tokens_details
        stats = plugin_stats(url)
        log.append({"step": step, "answer": text,
                    "cached_tokens": getattr(details, "cached_tokens", 0) if details else 0,
                    "images_compressed": stats.get("images_compressed"),
                    "spans_reused": stats.get("spans_reused"),
                    "compressed_slots_held": stats.get("compressed_slots_held")})
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--images", nargs="+", required=True, help="one screenshot per step")
    args = parser.parse_args()
    for entry in run(args.url, args.images):
        print(f"{entry['step']} -> {entry['answer']!r} (cached tokens: {entry['cached_tokens']}; "
              f"compressed so far: {entry['images_compressed']}, reused: "
              f"{entry['spans_reused']}, slots held: {entry['compressed_slots_held']})")


if __name__ == "__main__":
    main()
