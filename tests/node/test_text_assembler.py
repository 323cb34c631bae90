"""node/textgen.py `TextAssembler`: stop strings cut the same text as the assembler that rescanned one growing
string did (kept here as `RescanAssembler`, the reference), on random streams with random stop strings, while the
text it holds back between tokens stays shorter than the longest stop string (the work per token is bounded:
each stop string is looked for over that held text plus the new text only)."""

from __future__ import annotations

import random

from engine.model.tokenizer import ByteTokenizer
from node.textgen import TextAssembler


class RescanAssembler:
    """The reference: the whole text in one string, every stop string looked for from the last emitted point."""

    def __init__(self, tokenizer, stop_strings=(), context_ids=()) -> None:
        self.decoder = tokenizer.decoder(context_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.text += self.decoder.add(token_id)
        for stop in self.stop_strings:
            at = self.text.find(stop, max(0, self.emitted - len(stop)))
            if at >= 0:
                self.stopped = True
                self.text = self.text[:at]
                return self._take(len(self.text))
        hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        return self._take(max(self.emitted, len(self.text) - hold))

    def flush(self) -> str:
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta


def _run(assembler, ids):
    deltas = []
    for token_id in ids:
        deltas.append(assembler.add(token_id))
        if assembler.stopped:
            break
    deltas.append(assembler.flush())
    return deltas, assembler.stopped, assembler.text


def test_stop_strings_cut_as_the_rescanning_reference_does():
    tokenizer = ByteTokenizer()
    rng = random.Random(5)
    words = ["ab", "abc", "b", "\u00e9t\u00e9", "\U0001f600", "END", "x"]
    for trial in range(300):
        text = "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randrange(1, 40)))
        ids = tokenizer.encode(text, add_bos=False)
        if rng.random() < 0.3:  # specials and stray bytes in between
            ids = [t for i in ids for t in ([rng.choice([256, 300, 0x80])] if rng.random() < 0.1 else []) + [i]]
        stops = [rng.choice(words + [text[i:i + 3] for i in range(0, len(text), 7)]) for _ in range(rng.randrange(4))]
        ours = _run(TextAssembler(tokenizer, stops, [72, 105]), ids)
        reference = _run(RescanAssembler(tokenizer, stops, [72, 105]), ids)
        assert ours == reference, (trial, text, stops)


def test_the_text_held_back_stays_shorter_than_the_longest_stop_string():
    tokenizer = ByteTokenizer()
    stops = ["z" * 256, "never here", "q" * 100]
    assembler = TextAssembler(tokenizer, stops)
    rng = random.Random(1)
    emitted = 0
    for _ in range(20_000):
        emitted += len(assembler.add(rng.randrange(97, 122)))
        assert len(assembler._held) <= 255
    assert emitted + len(assembler.flush()) == 20_000 and not assembler.stopped
