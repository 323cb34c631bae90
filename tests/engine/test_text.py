"""Byte tokenizer, chat template and the sampler."""

from __future__ import annotations

import pytest
import torch

from engine.model.tokenizer import BOS_ID, END_ID, ROLE_ID, ByteTokenizer, ChatMessage
from engine.sampling import SamplingParams, sample


def test_byte_tokenizer_round_trips_utf8_and_skips_specials() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([104, 999, 105]) == "hi" and "<|999|>" in tok.decode([999], skip_special=False)


def test_chat_template() -> None:
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([ChatMessage("user", "hi")])
    assert ids == [BOS_ID, ROLE_ID, *b"user\nhi", END_ID, ROLE_ID, *b"assistant\n"]


def test_greedy_takes_the_lowest_id_among_ties_and_reports_logprob() -> None:
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0])
    out = sample(logits, SamplingParams(), seed=0, step=0)
    assert out.token_id == 1
    assert out.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[1]))


def test_seeded_top_p_stays_in_the_nucleus_and_repeats() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    draws = [sample(logits, params, seed=7, step=s).token_id for s in range(200)]
    assert set(draws) == {0, 1}  # p(0) ~ 0.72 < 0.9, so the nucleus is {0, 1}
    assert draws == [sample(logits, params, seed=7, step=s).token_id for s in range(200)]
