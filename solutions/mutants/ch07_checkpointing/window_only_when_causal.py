"""Wrong: applies the window only to causal attention; without causal every key is seen.

Sliding windows are usually met in decoders, so a student may build the window into the causal mask
and forget the bidirectional case (an encoder's local attention), where query i must see |i − j| < w.
"""
import math

import torch


class SelectiveAttention(SelectiveAttention):

    @staticmethod
    def probs(q, k, causal, window):
        s = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            i = torch.arange(s, device=q.device)
            offset = i[:, None] - i[None, :]
            seen = (offset >= 0) & (offset < (window or s))
            scores = scores.masked_fill(~seen, float("-inf"))
        return scores.softmax(dim=-1)
