"""Scripted answers for the synthetic engine (``--script FILE``): the text a request generates.

A test of what is done with generated text (tool-call parsing, stop strings, an SDK's stream
assembly) needs a worker on a real socket whose output is known. With a script, the synthetic
engine's requests answer its texts in turn (the first request the first text, ...), each cut
into pieces of :data:`PIECE_CHARS` characters, one generated id a piece, then end-of-sequence
(``finish_reason: "stop"``), or ``max_tokens`` first (``"length"``).

The file is one answer (its whole text), or, named ``*.json``, a JSON list of answer strings.

Every piece has an id of its own (answer ``k``'s piece ``p`` is ``base[k] + p``), so an id says
which answer it belongs to: a generation worker handed a context worker's first token
(``first_gen_tokens``) goes on with that answer, whatever its own turn, and a disaggregated
answer is the one a single worker gives.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

#: characters of answer text per generated id: small, so that a tag is cut across several deltas
PIECE_CHARS = 3


class Script:
    """The answers and their ids; ``vocab`` bounds them (the id ``eos`` ends each answer)."""

    def __init__(self, answers: list[str], *, eos: int, vocab: int) -> None:
        if not answers or not all(isinstance(a, str) for a in answers):
            raise ValueError("a script is a non-empty list of answer strings")
        self.answers = answers
        self.eos = eos
        self.pieces: list[str] = []  # id - 1 -> its text
        self.bases: list[int] = []
        for answer in answers:
            self.bases.append(len(self.pieces) + 1)
            self.pieces += [answer[i : i + PIECE_CHARS] for i in range(0, len(answer), PIECE_CHARS)]
        if len(self.pieces) + 1 >= min(eos, vocab):
            raise ValueError(
                f"the script's answers need {len(self.pieces)} ids: more than the vocabulary holds"
            )
        self.turn = 0

    @classmethod
    def load(cls, path: str | Path, *, eos: int, vocab: int) -> Script:
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            try:
                answers = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"{path}: not JSON: {exc}") from None
            if not isinstance(answers, list):
                raise ValueError(f"{path}: a .json script is a list of answer strings")
            return cls(answers, eos=eos, vocab=vocab)
        return cls([text], eos=eos, vocab=vocab)

    def answer_of(self, forced: list[int]) -> int:
        """The answer a request generates: the one its forced first token belongs to, else the next in turn."""
        if forced and 1 <= forced[0] <= len(self.pieces):
            return bisect.bisect_right(self.bases, forced[0]) - 1
        answer = self.turn
        self.turn = (self.turn + 1) % len(self.answers)
        return answer

    def token(self, answer: int, position: int) -> int:
        """The id generated at ``position`` of ``answer``; end-of-sequence past its last piece."""
        base = self.bases[answer]
        end = self.bases[answer + 1] if answer + 1 < len(self.bases) else len(self.pieces) + 1
        return base + position if base + position < end else self.eos

    def piece(self, token_id: int) -> str | None:
        """The text of a script id, or None for an id that is none."""
        return self.pieces[token_id - 1] if 1 <= token_id <= len(self.pieces) else None


__all__ = ["PIECE_CHARS", "Script"]
