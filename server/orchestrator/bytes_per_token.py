# cython: annotation_typing=False, auto_pickle=False
"""A pool's smoothed prompt bytes per token (:class:`BytesPerToken`, :mod:`.estimates`' learner),
written once: this module is the pure twin, and Cython compiles the same source, in its pure-Python
mode, into ``server.orchestrator._bytes_per_token`` (setup.py), the compiled twin, typed by
``_bytes_per_token.pxd`` (a ``cdef class`` whose fields and ``observe``'s locals are C doubles).
Nothing here imports Cython (a build dependency only); the annotations are for mypy alone
(``annotation_typing=False``: an ``int`` argument typed by Cython would refuse a float the pure twin
takes).

Measured against the hand-written ``cdef class`` it replaced in _tally.pyx (callgrind, 200,000
``observe`` calls from Python, inclusive instructions per call): 616 there, 606 here; the same
results to the bit (tests/test_tally_twins.py). :mod:`.estimates` exports the twin twins.py picks.
"""

from __future__ import annotations

__all__ = ["DEFAULT_BYTES_PER_TOKEN", "BytesPerToken"]

#: the figure before anything is known (agentic chat JSON: about 4)
DEFAULT_BYTES_PER_TOKEN = 4.0
#: a sample outside this range is no tokenizer's (a worker that counts nothing, a stub): ignored
MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN = 0.25, 64.0
#: each new answer keeps this much of the sums before it (~100 answers of memory)
DECAY = 0.99
#: a published seed counts as this many tokens already seen (a few answers outweigh it)
SEED_TOKENS = 4096.0
#: an answer's ratio counts at most this factor away from the figure (padding in a prompt, a
#: tokenizer's quirk: it pulls as hard as a ratio twice the figure, in its tokens' share)
OUTLIER_FACTOR = 2.0
#: and moves the figure by at most this factor: no single request moves it much
MAX_STEP = 1.05


class BytesPerToken:
    """A pool's smoothed prompt bytes per token (one model per orchestrator: ``config.model``).

    ``value``: the current figure; ``observed``: answers learned from (a seed counts none).
    """

    __slots__ = ("_bytes", "_tokens", "observed", "value")

    def __init__(self, initial: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        self.value = float(initial)
        self._bytes = self._tokens = 0.0
        self.observed = 0

    def seed(self, published: float | None) -> None:
        """A worker's published figure: taken until answers were learned from, then ignored."""
        if published is None or self.observed or not MIN_BYTES_PER_TOKEN <= published <= MAX_BYTES_PER_TOKEN:
            return
        self.value = float(published)
        self._tokens = SEED_TOKENS
        self._bytes = SEED_TOKENS * self.value

    def observe(self, prompt_bytes: int, prompt_tokens: int | None) -> None:
        """One answer: ``prompt_tokens`` tokens for ``prompt_bytes`` bytes of the prompt's span.

        The decayed sums' ratio, bounded twice so that no answer moves the figure much: the answer's
        own ratio counts at most :data:`OUTLIER_FACTOR` from the figure, and the figure moves by at
        most :data:`MAX_STEP`; the sums are then rescaled to the figure, so an outlier does not
        stay in them to pull at every later answer. A tenant's padded prompts move it in proportion
        to their share of the prompt tokens, each by under 5%."""
        if not prompt_tokens or prompt_bytes <= 0:
            return
        ratio = prompt_bytes / prompt_tokens
        if not MIN_BYTES_PER_TOKEN <= ratio <= MAX_BYTES_PER_TOKEN:
            return
        value = self.value
        nbytes: float = prompt_bytes
        ntokens: float = prompt_tokens  # an int to Python (exact below 2**53), a C double compiled
        low, high = value / OUTLIER_FACTOR, value * OUTLIER_FACTOR
        if ratio < low:
            nbytes = low * ntokens
        elif ratio > high:
            nbytes = high * ntokens
        tokens = self._tokens * DECAY + ntokens
        target = (self._bytes * DECAY + nbytes) / tokens
        low, high = value / MAX_STEP, value * MAX_STEP
        if target < low:
            target = low
        elif target > high:
            target = high
        self._tokens = tokens
        self._bytes = target * tokens
        self.value = target
        self.observed += 1

    def tokens(self, nbytes: int | float) -> int:
        """The tokens ``nbytes`` prompt bytes are estimated to hold."""
        return int(nbytes / self.value)
