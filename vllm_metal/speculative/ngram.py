"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier
occurrence of a request's last n tokens, found by vLLM's own matcher.

vLLM's NgramProposer runs its numba matcher over a [max_num_seqs,
max_model_len] token array its GPU runner keeps; here each request's tokens
live in growing numpy buffers (one per request, appended as tokens arrive)
and the same matcher (`_find_longest_matched_ngram_and_propose_tokens`, the
longest suffix n-gram in [prompt_lookup_min, prompt_lookup_max], its latest
earlier occurrence, up to k tokens after it) runs on each.
"""

from __future__ import annotations

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens


class TokenHistory:
    """A request's tokens (prompt + output) as one int32 array, appended in place."""

    def __init__(self):
        self.buf = np.empty(0, np.int32)
        self.n = 0

    def sync(self, prompt: list[int], output: list[int]) -> np.ndarray:
        """The tokens, brought up to date with `prompt + output` (only the
        new tail is copied; a shorter list, or one whose last kept token
        changed, starts over -- a stale history could only cost acceptance:
        every draft is verified)."""
        total = len(prompt) + len(output)
        if self.n > total or self.n < len(prompt) or \
                (self.n > len(prompt) and self.buf[self.n - 1] != output[self.n - 1 - len(prompt)]):
            self.n = 0
        if self.n == 0:
            self._reserve(total)
            self.buf[:len(prompt)] = prompt
            self.n = len(prompt)
        if total > self.n:
            self._reserve(total)
            self.buf[self.n:total] = output[self.n - len(prompt):]
            self.n = total
        return self.buf[:self.n]

    def _reserve(self, size: int) -> None:
        if size > self.buf.shape[0]:
            grown = np.empty(max(size, 2 * self.buf.shape[0], 256), np.int32)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int, k: int, max_model_len: int):
        self.min_n, self.max_n, self.k, self.max_model_len = min_n, max_n, k, max_model_len
        self.histories: dict[str, TokenHistory] = {}

    def propose(self, req_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Up to min(k, self.k) drafts for the request's next positions ([] when no n-gram matches)."""
        history = self.histories.get(req_id)
        if history is None:
            history = self.histories[req_id] = TokenHistory()
        tokens = history.sync(prompt, output)
        k = min(k, self.k)
        if k <= 0 or tokens.shape[0] >= self.max_model_len:
            return []
        return _find_longest_matched_ngram_and_propose_tokens(
            tokens, self.min_n, self.max_n, self.max_model_len, k).tolist()

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self.histories.pop(r, None)
