"""An agent loop with the OpenAI client that re-sends the same screenshot at every step.

    python examples/agent_screenshot.py --url http://127.0.0.1:30000 --image screen.png

Each step sends the whole history with the screenshot first, as agent frameworks do; from step 2
on the server reuses the compressed screenshot instead of encoding and prefilling it again.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

from openai import OpenAI

STEPS = ["What is on the screen?", "Which button should be clicked next?", "Describe the page."]


def run(url: str, image_path: str, steps: list[str] = STEPS, max_tokens: int = 16) -> list[dict]:
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    image_url = "data:image/png;base64," + base64.b64encode(Path(image_path).read_bytes()).decode()
    history = [{"role": "system", "content": "You are a helpful screen agent."}]
    log = []
    for step in steps:
        screenshot = {"type": "image_url", "image_url": {"url": image_url}}
        messages = [*history, {"role": "user", "content": [screenshot,
                                                           {"type": "text", "text": step}]}]
        reply = client.chat.completions.create(model="default", messages=messages,
                                               temperature=0, max_tokens=max_tokens)
        text = reply.choices[0].message.content
        details = reply.usage.prompt_tokens_details
        log.append({"step": step, "answer": text,
                    "cached_tokens": getattr(details, "cached_tokens", 0) if details else 0})
        history += [{"role": "user", "content": step}, {"role": "assistant", "content": text}]
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--image", required=True)
    args = parser.parse_args()
    for entry in run(args.url, args.image):
        print(f"{entry['step']} -> {entry['answer']!r} (cached: {entry['cached_tokens']})")


if __name__ == "__main__":
    main()
