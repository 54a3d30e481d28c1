"""Render the configuration reference (``docs/configuration.md``) from ``UniCacheConfig``.

The reference is made from the dataclass itself: each field's default, and the one-line meaning and
section title its ``doc(...)`` puts in the field metadata (``sglang_unicache/policy/config.py``), so
it cannot drift; a unit test fails when the committed file is stale. Run from the repository root:

    python -m tools.config_doc > docs/configuration.md
"""

from __future__ import annotations

import dataclasses

from sglang_unicache.policy.config import PRESETS, UniCacheConfig

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
        "multiplies the keep ratio by `escalate_factor` (sqrt 2) up to `escalate_max_keep` "
        "before the request keeps its full KV; with host copies the check guards the "
        "request's own answer, and on the bundled model (n = 300 multi-token answers) its "
        "first rung, 9 entries of 64 (0.141x), answers 99.3% against 91.3% at 6 entries. "
        "The server warns once when most recent images fall back."),
}


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `sglang_unicache/policy/config.py` by `python -m tools.config_doc`;",
        "do not edit by hand. Pass any key in a JSON or YAML file with `--unicache-config PATH`",
        "(flags `--unicache-method`, `--unicache-keep-ratio`, `--unicache-min-image-tokens` win",
        "over the file). Unknown keys and out-of-range values stop the server with one line.",
        "",
    ]
    for i, field in enumerate(dataclasses.fields(UniCacheConfig)):
        section = field.metadata.get("section")
        if i == 0 and section is None:
            raise ValueError(f"the first config field ({field.name}) must open a section")
        if section is not None:
            lines += ["", f"## {section}", ""]
            if section in NOTES:
                lines += [NOTES[section], ""]
            lines += ["| key | default | meaning |", "| --- | --- | --- |"]
        lines.append(f"| `{field.name}` | `{field.default!r}` | {field.metadata.get('doc', '')} |")
    lines += ["", "## Presets (seed §8.2)", "", "| preset | overrides |", "| --- | --- |"]
    for name, overrides in PRESETS.items():
        shown = ", ".join(f"`{k}={v}`" for k, v in overrides.items()) or "none"
        lines.append(f"| `{name}` | {shown} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
