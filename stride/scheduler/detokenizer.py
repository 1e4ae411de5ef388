"""Incremental detokenization and stop strings.

`tokenizers.decoders.DecodeStream` turns one token at a time into text, holding back bytes of an
unfinished UTF-8 character. Stop strings are searched in a window that reaches back far enough to
catch a stop string split across tokens; text that could still be the start of a stop string is
held back from the stream until it can no longer match. Without stop strings nothing depends on
the text until it is taken, so tokens are only queued on `add` and decoded on `take`: the engine
can launch its next forward pass first and decode while the GPU runs it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class Detokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: list[str], skip_special_tokens: bool
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all text decoded so far (up to a stop string, once one is found)
        self._sent = 0  # how much of `text` was handed out already
        self._queued: list[int] = []  # tokens not decoded yet (only without stop strings)

    def add(self, token_id: int) -> str | None:
        """Feed one token; returns the stop string if the text now contains one."""
        if not self._stop:
            self._queued.append(token_id)
            return None
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        found = [(at, stop) for stop in self._stop if (at := self.text.find(stop, start)) != -1]
        if not found:
            return None
        at, stop = min(found)
        self.text = self.text[:at]
        return stop

    def take(self, final: bool) -> str:
        """New text safe to send: everything at the end, else all but a possible stop prefix."""
        if self._queued:
            step, backend = self._stream.step, self._backend
            self.text += "".join(filter(None, (step(backend, t) for t in self._queued)))
            self._queued.clear()
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out
