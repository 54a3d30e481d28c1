"""Render the configuration reference (``docs/configuration.md``) from ``UniCacheConfig``.

The reference is generated from the dataclass (fields, defaults, section headers and field
comments in ``config.py``) so it cannot drift; a unit test fails when the committed file is stale.

    python -m sglang_unicache.config_doc > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from sglang_unicache.config import PRESETS, UniCacheConfig

_FIELD = re.compile(r"^\s{4}(\w+): [^=]+=\s*(.+?)(?:\s+#\s*(.*))?$")
_SECTION = re.compile(r"^\s{4}# -- (.+?) -+$")
# A paragraph under a section, where its defaults need the story of how they were chosen.
NOTES = {
    "self-check and dynamic rate (seed §7.1, §7.2)": (
        "How the default was chosen (`docs/selfcheck.md`): on the bundled trained model, every "
        "method at keep 5/10/25% in the reuse setting (630 compressed images), each image's "
        "self-check statistics were recorded and compared with whether compression changed "
        "the answers to its later questions. The seed's attention KL predicted harm best "
        "(ROC AUC 0.885; per-head KL 0.880, image mass lost 0.857, output error 0.821, key "
        "coverage 0.629). The threshold that separates harmed from unharmed images best "
        "(Youden's J) is 0.906 without the random baseline and 1.145 with it; 0.9 is within "
        "0.01 of the best J in both. The seed's 0.1 failed every image. A failed check "
        "doubles the keep ratio up to `escalate_max_keep` before the request keeps its full "
        "KV; the server warns once when most recent images fall back."),
}


def render() -> str:
    defaults = {f.name: f.default for f in dataclasses.fields(UniCacheConfig)}
    lines = [
        "# Configuration reference",
        "",
        "Generated from `sglang_unicache/config.py` by `python -m sglang_unicache.config_doc`;",
        "do not edit by hand. Pass any key in a JSON or YAML file with `--unicache-config PATH`",
        "(flags `--unicache-method`, `--unicache-keep-ratio`, `--unicache-min-image-tokens` win",
        "over the file). Unknown keys and out-of-range values stop the server with one line.",
        "",
    ]
    for line in inspect.getsource(UniCacheConfig).splitlines():
        section = _SECTION.match(line)
        if section:
            lines += ["", f"## {section.group(1)}", ""]
            if section.group(1) in NOTES:
                lines += [NOTES[section.group(1)], ""]
            lines += ["| key | default | meaning |", "| --- | --- | --- |"]
            continue
        field = _FIELD.match(line)
        if field and field.group(1) in defaults:
            name, _, comment = field.groups()
            lines.append(f"| `{name}` | `{defaults[name]!r}` | {comment or ''} |")
    lines += ["", "## Presets (seed §8.2)", "", "| preset | overrides |", "| --- | --- |"]
    for name, overrides in PRESETS.items():
        shown = ", ".join(f"`{k}={v}`" for k, v in overrides.items()) or "none"
        lines.append(f"| `{name}` | {shown} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
