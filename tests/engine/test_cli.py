"""`pdcluster generate`: JSON output through the real console script; bad input exits with status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.cli import main
from tests.oracle import generate_text


@pytest.mark.process
def test_generate_json_through_the_console_script() -> None:
    cmd = [sys.executable, "-m", "pdcluster", "generate", "--model", "kimi-k3.1-mini", "--prompt", "Hello",
           "--max-tokens", "3", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_token_ids"] == [256] + list(b"Hello")
    assert len(out["token_ids"]) == 3 and isinstance(out["text"], str)
    assert {"ttft_s", "decode_s", "total_s"} <= set(out["timings"])
    # the suite's in-process oracle answers what the console script prints, log-probs bit for bit
    mine = generate_text("Hello", 3)
    assert {k: out[k] for k in mine if k != "model"} == {k: v for k, v in mine.items() if k != "model"}


def test_generate_is_deterministic_and_seeded_sampling_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for argv in (["--prompt", "abc", "--max-tokens", "2", "--json"],
                 ["--prompt", "abc", "--max-tokens", "2", "--json"],
                 ["--prompt", "abc", "--max-tokens", "2", "--json", "--temperature", "1", "--seed", "4"],
                 ["--prompt", "abc", "--max-tokens", "2", "--json", "--temperature", "1", "--seed", "4"]):
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert runs[0] == runs[1] and runs[2] == runs[3]


@pytest.mark.parametrize("argv,message", [
    (["--model", "nope", "--prompt", "x"], "unknown model preset"),
    (["--prompt", "", "--max-tokens", "3"], "empty"),
    (["--prompt", "x", "--max-tokens", "0"], "must be positive"),
    (["--prompt", "x" * 32767, "--max-tokens", "4"], "maximum context length"),
], ids=["preset", "empty-prompt", "max-tokens", "too-long"])
def test_bad_input_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_prompt_ids_equal_the_text_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """--prompt-ids takes the ids as they are: BOS + the bytes of "abc" answer as --prompt abc does."""
    assert main(["--prompt", "abc", "--max-tokens", "3", "--json"]) == 0
    text = json.loads(capsys.readouterr().out)
    assert main(["--prompt-ids", json.dumps([256, 97, 98, 99]), "--max-tokens", "3", "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids["prompt_token_ids"] == text["prompt_token_ids"] == [256, 97, 98, 99]
    assert ids["token_ids"] == text["token_ids"] and ids["logprobs"] == text["logprobs"]
    assert main(["--prompt-ids", "[97, 98]", "--max-tokens", "2", "--json"]) == 0  # no BOS added
    assert json.loads(capsys.readouterr().out)["prompt_token_ids"] == [97, 98]


@pytest.mark.parametrize("ids,message", [
    ("[1, 2", "not JSON"), ("[]", "non-empty JSON list"), ('["a"]', "non-empty JSON list"),
    ("[true]", "non-empty JSON list"), ("[1, 999999]", "out of range"),
])
def test_bad_prompt_ids_exit_2(ids: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--prompt-ids", ids, "--max-tokens", "2"]) == 2
    assert message in capsys.readouterr().err


def test_prompt_and_prompt_ids_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        main(["--prompt", "x", "--prompt-ids", "[1]"])


def test_text_prompt_of_a_checkpoint_goes_through_its_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --model DIR --prompt TEXT` encodes with the checkpoint's own tokenizer (the ids transformers'
    AutoTokenizer gives), and its answer is the `--prompt-ids` answer for those ids."""
    transformers = pytest.importorskip("transformers")
    from tests.checkpoint_tokenizer import save_bpe_tokenizer
    from tests.checkpoints import checkpoint_dir

    model = str(checkpoint_dir("kimi-mix", tokenizer=save_bpe_tokenizer))
    text = "The agent reads the file, caf\u00e9 \u4f60\u597d"
    expected_ids = transformers.AutoTokenizer.from_pretrained(model).encode(text)
    assert main(["--model", model, "--prompt", text, "--max-tokens", "4", "--json"]) == 0
    by_text = json.loads(capsys.readouterr().out)
    assert by_text["prompt_token_ids"] == expected_ids
    assert main(["--model", model, "--prompt-ids", json.dumps(expected_ids), "--max-tokens", "4", "--json"]) == 0
    by_ids = json.loads(capsys.readouterr().out)
    assert by_text["token_ids"] == by_ids["token_ids"] and by_text["text"] == by_ids["text"]
