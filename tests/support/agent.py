"""An agent loop against a test server (``examples/agent_screenshot.py``): a new screenshot each
step, the history resent, and what the plugin's counters did over the loop."""

from __future__ import annotations

from pathlib import Path

from tests.support.client import internal_state


def agent_loop(server, screenshots: list[bytes], folder: Path,
               image_fields: dict | None = None) -> tuple[list[dict], dict]:
    """Run the loop over ``screenshots`` (PNG bytes); (its log, each counter's change)."""
    from examples import agent_screenshot

    paths = []
    for i, png in enumerate(screenshots):
        path = folder / f"screen{i}.png"
        path.write_bytes(png)
        paths.append(str(path))
    before = internal_state(server)["unicache"]
    log = agent_screenshot.run(server.url, paths, max_tokens=4, image_fields=image_fields)
    after = internal_state(server)["unicache"]
    return log, {name: after[name] - before[name] for name in
                 ("images_prefilled", "images_compressed", "spans_reused", "spans_recalled")}


def assert_each_screenshot_encoded_and_compressed_once(server, screenshots, folder,
                                                       image_fields: dict | None = None) -> None:
    """Every step encodes only its new screenshot and compresses it: the earlier ones come from
    the cache (recalled from a host copy, then compressed to the step's own view, or reused
    compressed)."""
    log, delta = agent_loop(server, screenshots, folder, image_fields)
    steps = len(screenshots)
    assert all(entry["answer"] is not None for entry in log)
    assert delta["images_prefilled"] == steps, delta
    # A recalled screenshot is prefilled whole from its host copy and compresses its own view.
    assert delta["images_compressed"] == steps + delta["spans_recalled"], delta
    assert delta["spans_reused"] + delta["spans_recalled"] >= steps - 1, delta
