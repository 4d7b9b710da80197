"""A request's output text, detokenized incrementally, for the one token loop (``serving/request.py``)
that every runtime streams through: the same tokens give the same text everywhere."""
from __future__ import annotations


class OutputText:
    """The text of the tokens generated so far, cut at the first stop string. What is streamed
    holds back a trailing partial UTF-8 character (U+FFFD) and anything that may still become a
    stop string, until the next token (or the end) settles it: no part of a stop string reaches
    the client."""

    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.text = ""
        self._sent = 0  # characters of ``text`` already streamed
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def update(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """Re-decode the whole output ``token_ids``; return the text to stream now and whether a stop
        string ended it (the text is cut there). ``final``: the request ends with this token."""
        stopped = self._decode(token_ids) if self.tokenizer is not None else False
        hold = 0 if final or stopped else self._holdback()
        delta = self.text[self._sent:len(self.text) - hold]
        self._sent += len(delta)
        return delta, stopped

    def _decode(self, token_ids: list[int]) -> bool:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        start = max(0, self._sent - self._max_stop)
        cut = min((i for s in self.stop if (i := text.find(s, start)) >= 0), default=-1)
        self.text = text if cut < 0 else text[:cut]
        return cut >= 0

    def _holdback(self) -> int:
        hold = 1 if self.text.endswith("\ufffd") else 0
        tail = self.text[self._sent:]
        for s in self.stop:
            for n in range(min(len(s) - 1, len(tail)), 0, -1):
                if tail.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
