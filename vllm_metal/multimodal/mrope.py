"""M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): three position streams
(temporal, height, width) per token. Text tokens carry the same position in
all three; an image's tokens carry (t, row, column) offset by the text before
it, and the text after an image continues from the largest position used + 1
(so a request's positions run `delta` behind or ahead of its token count).

Each rotary frequency takes one stream: in contiguous sections
(`mrope_section`, Qwen2-VL / 2.5-VL) or interleaved t, h, w, t, h, w, ...
(Qwen3-VL / Qwen3.5, `mrope_interleaved`). The rotation is the text model's
own RoPE module's (cos, sin) table at each stream's positions, merged per
frequency: built once per step and shared by every layer, through the same
RoPE primitive as plain text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MRopeSpec:
    sections: tuple[int, int, int]  # frequencies per stream (sum: rotated dims / 2)
    interleaved: bool
    merge: int  # the vision tower's spatial merge (grid units per text token side)

    def stream_of_frequency(self, half: int) -> np.ndarray:
        """int [half]: which stream (0 t, 1 h, 2 w) each rotary frequency takes."""
        if sum(self.sections) != half:
            raise ValueError(f"mrope_section {list(self.sections)} does not cover {half} rotary frequencies")
        if not self.interleaved:
            return np.repeat(np.arange(3), self.sections)
        out = np.zeros(half, np.int64)
        for stream in (1, 2):  # as transformers' apply_interleaved_mrope: h at 1, 4, ...; w at 2, 5, ...
            out[np.arange(stream, self.sections[stream] * 3, 3)] = stream
        return out

    def positions(self, num_tokens: int, images: list[tuple[int, tuple[int, int, int]]]) -> tuple[np.ndarray, int]:
        """A prompt's positions: (int64 [3, num_tokens], delta), where images
        are (placeholder offset, (t, h, w) patch grid) in prompt order and
        every image's placeholder is t*h*w / merge^2 tokens. Tokens past the
        prompt sit at position index + delta in all three streams."""
        out = np.zeros((3, num_tokens), np.int64)
        cursor, next_pos = 0, 0
        for offset, (t, h, w) in sorted(images):
            gh, gw = h // self.merge, w // self.merge
            length = t * gh * gw
            if offset < cursor or offset + length > num_tokens:
                raise ValueError(f"an image placeholder at {offset} ({length} tokens) overlaps another or "
                                 f"runs past the prompt ({num_tokens} tokens)")
            text = offset - cursor
            out[:, cursor:offset] = next_pos + np.arange(text)
            next_pos += text
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            out[0, offset:offset + length] = next_pos + tt.reshape(-1)
            out[1, offset:offset + length] = next_pos + hh.reshape(-1)
            out[2, offset:offset + length] = next_pos + ww.reshape(-1)
            next_pos += max(gh, gw, t)
            cursor = offset + length
        out[:, cursor:] = next_pos + np.arange(num_tokens - cursor)
        last = int(out[:, -1].max()) if num_tokens else -1
        return out, last + 1 - num_tokens
