"""A multi-turn conversation about one image with SGLang's frontend language (``sgl.image``).

    python examples/sgl_multiturn.py --url http://127.0.0.1:30000 --image photo.png

Turn 2 and 3 reuse turn 1's compressed image from the radix tree (see ``/server_info``).
"""

from __future__ import annotations

import argparse

import sglang as sgl


@sgl.function
def conversation(s, image_path: str, questions: list[str], max_tokens: int):
    s += sgl.user(sgl.image(image_path) + questions[0])
    s += sgl.assistant(sgl.gen("answer_0", max_tokens=max_tokens, temperature=0))
    for i, question in enumerate(questions[1:], start=1):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=max_tokens, temperature=0))


def run(url: str, image_path: str, questions: list[str], max_tokens: int = 16) -> list[dict]:
    state = conversation.run(image_path=image_path, questions=questions, max_tokens=max_tokens,
                             backend=sgl.RuntimeEndpoint(url))
    return [{"question": q, "answer": state[f"answer_{i}"],
             "meta": state.get_meta_info(f"answer_{i}")} for i, q in enumerate(questions)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--image", required=True)
    args = parser.parse_args()
    turns = run(args.url, args.image, ["What colour is the circle?", "How many objects are there?",
                                       "List the colours of the objects from top to bottom."])
    for turn in turns:
        print(f"Q: {turn['question']}\nA: {turn['answer']}  "
              f"(cached prompt tokens: {turn['meta']['cached_tokens']})")


if __name__ == "__main__":
    main()
