"""Wrong: lets query i see keys with i - j <= window, one key more than the window.

"A window of w" read as "w keys back" rather than "w keys, itself included": an off-by-one at the
boundary of the mask. Full attention (window None) is unaffected; every windowed output is not.
"""
import math

import torch


class SelectiveAttention(SelectiveAttention):

    @staticmethod
    def probs(q, k, causal, window):
        s = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        i = torch.arange(s, device=q.device)
        offset = i[:, None] - i[None, :]
        seen = offset >= 0 if causal else torch.ones(s, s, dtype=torch.bool, device=q.device)
        if window is not None:
            seen = seen & (offset.abs() <= window)
        return scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
