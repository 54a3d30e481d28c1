"""What the plugin knows about one request: its typed state, and the questions asked of it.

The state lives on the request (``req.unicache``, made on first use by ``state_of``), so it dies
with it: an aborted or finished request leaves nothing behind in the plugin. Who writes what:

| field | written by | read by |
| --- | --- | --- |
| ``rewrites`` | ``reuse.py`` (match time), ``compress.py`` (after prefill) | both; ``undo`` |
| ``removed`` | ``rewrite.py`` (every rewrite and restore) | positions (1-D RoPE), usage |
| ``reused`` | ``reuse.py`` | usage (cached tokens as the user sent them) |
| ``matched`` | ``reuse.py`` | ``reuse.py`` (decide again only when the span index changed) |
| ``fresh`` | ``compress.py`` | the radix cache, which takes it when the KV enters the tree |
| ``recall`` | ``recall.py`` (match time) | ``recall.py`` (admission's load) |
| ``private`` | ``recall.py`` (admission's load) | ``recall.py`` (a new decision undoes it) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_unicache.engine.recall import RecallPlan
    from sglang_unicache.engine.rewrite import Rewrite
    from sglang_unicache.engine.spans import SpanMeta

ATTRIBUTE = "unicache"


@dataclass
class RequestState:
    """One request's plugin state (see the module docstring for its writers and readers)."""

    rewrites: list[Rewrite] = field(default_factory=list)  # every rewrite of its ids, oldest first
    removed: int = 0  # prompt tokens its ids no longer hold (the sum over ``rewrites``)
    reused: int = 0  # of those, the ones reused spans stood for
    matched: int | None = None  # the span index epoch its reuse was decided at
    fresh: list[tuple[int, SpanMeta]] | None = None  # (row position, metadata) it compressed
    recall: RecallPlan | None = None  # its image loaded back in full at admission
    private: bool = False  # recall barred its KV from the tree (``skip_radix_cache_insert``)

    def take_fresh(self) -> list[tuple[int, SpanMeta]]:
        fresh, self.fresh = self.fresh or [], None
        return fresh


def state_of(req) -> RequestState:
    """The request's state, made on first use."""
    state = getattr(req, ATTRIBUTE, None)
    if state is None:
        state = RequestState()
        setattr(req, ATTRIBUTE, state)
    return state


def existing_state(req) -> RequestState | None:
    """The request's state, None for a request the plugin never saw (nothing is made)."""
    return getattr(req, ATTRIBUTE, None)


def removed_of(req) -> int:
    """Prompt tokens the request's row does not hold (0 for a request the plugin never saw)."""
    state = existing_state(req)
    return state.removed if state is not None else 0


def full_kv_only(req) -> bool:
    """Requests served on their full KV, like stock SGLang (neither compressed nor rewritten to
    reuse compressed spans):

    - those that return logprobs: SGLang computes their prompt logprobs over the prompt as
      sent, after the point where compaction shortens it, and counts them against its length;
    - turns of an SGLang session (``open_session`` / ``session_params``): the session builds the
      next turn from this one's ids and multimodal inputs, which must stay the ones sent;
    - beam search (``beam_width``): the members copy the leader's prompt row inside the
      forward, before the leader reaches its checkpoint, so a compaction there would free slots
      the members still read; and a beam group's prompt length is fixed at admission, before
      any match-time rewrite;
    - requests SGLang keeps out of the radix tree (``skip_radix_cache_insert``: beam leaders,
      requests whose embeddings are overridden, so their KV is not what their ids say), except
      a recalled request the plugin itself keeps out (its KV is what its ids say).
    """
    private = req.skip_radix_cache_insert and not getattr(req, ATTRIBUTE, RequestState()).private
    return (bool(req.return_logprob) or req.session is not None or req.beam_group is not None
            or private)


def namespace(req) -> tuple[object, object]:
    """The radix tree's namespace of a request: spans never cross it (tenancy)."""
    return (req.extra_key, req.cache_salt or None)


def merge_runs(offsets) -> list[tuple[int, int]]:
    """An item's inclusive pad-token runs as ``[start, end)`` spans, runs one separator token
    apart joined (Pixtral-style towers end every row of patches with a break token: the image is
    one span, its break tokens compressed with it)."""
    spans: list[list[int]] = []
    for start, end in sorted(offsets):
        if spans and start - spans[-1][1] <= 1:
            spans[-1][1] = end + 1
        else:
            spans.append([start, end + 1])
    return [(start, end) for start, end in spans]
