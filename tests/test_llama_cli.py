"""`python -m examples.llama` given flags a demanding user tries: wrong sampling values, a
negative seed, flags that contradict each other, a prompt that encodes to nothing.  Each is
one clear error line and exit status 2, no traceback, before a weight is read."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the GGUF loader needs the gguf package: pip install -e '.[llama]'")
pytest.importorskip("tokenizers", reason="the tokenizer needs tokenizers: pip install -e '.[llama]'")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from test_llama_gguf import CFG, hf_weights, run_example, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    import numpy as np
    return write_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", CFG, hf_weights(np.random.default_rng(), CFG))


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "temperature=-1.0 must be a number in"),
    (["--temperature", "nan"], "temperature=nan must be a number"),
    (["--top-p", "7"], "top_p=7.0 must be a number in \\[0.0, 1.0\\]"),
    (["--top-k", "-3"], "top_k=-3 must be an integer"),
    (["--seed", "-1"], "seed=-1 must be an integer in \\[0, "),   # was numpy's ValueError from the random weights
    (["--gguf", "x.gguf", "--config", "config.json"], "--config applies to --weights or --random"),
    (["--prefill-chunk", "8", "--stream"], "--prefill-chunk needs the whole generation in one launch"),
])
def test_bad_or_contradicting_flags_are_one_error_line_before_a_model_is_read(capsys, flags, message):
    """The sampling flags and the seed raised a traceback after the weights were on the device;
    --config beside --gguf and --prefill-chunk beside --stream were silently ignored."""
    random = [] if "--gguf" in flags else ["--random"]
    code, out, err = run_example(capsys, random + ["--max-new", "2", "--prompt-len", "2", "--capacity", "64", *flags])
    assert code == 2 and out == ""
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m examples.llama: error: ")
    assert __import__("re").search(message, last), last


def test_a_prompt_that_encodes_to_no_tokens_is_refused_before_the_weights_are_read(gguf_file, capsys):
    """It loaded the weights, then said the prompt was 'of float64'."""
    code, out, err = run_example(capsys, ["--gguf", str(gguf_file), "--prompt", "", "--capacity", "64"])
    assert code == 2 and "weights on the device" not in out
    assert "--prompt '' encodes to no tokens: give some text" in err
    code, out, err = run_example(capsys, ["--gguf", str(gguf_file), "--chat", "--prompt", "", "--capacity", "64",
                                          "--max-new", "2"])
    assert code == 0 and "answer: " in out   # an empty chat turn still has the template's tokens


def test_weights_given_a_file_says_it_takes_a_directory(gguf_file, capsys):
    """It said the file 'is not valid JSON' (read as the config)."""
    code, out, err = run_example(capsys, ["--weights", str(gguf_file)])
    assert code == 2 and out == ""
    assert f"--weights takes a Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json); " \
           f"{gguf_file} is not a directory (a GGUF file: --gguf)" in err


def test_prompt_len_beside_a_text_prompt_is_refused(gguf_file, capsys):
    """--prompt-len was silently ignored when the prompt was text."""
    code, out, err = run_example(capsys, ["--gguf", str(gguf_file), "--prompt", "hello", "--prompt-len", "5"])
    assert code == 2 and "weights on the device" not in out
    assert "--prompt-len makes a random prompt for a model without a tokenizer" in err


def test_a_text_prompt_for_random_weights_names_the_missing_tokenizer_first(capsys):
    """Beside --prompt-len it said "pass --random" to a command that had passed --random."""
    for flags in (["--prompt", "hi"], ["--chat"]):
        code, out, err = run_example(capsys, ["--random", "--prompt-len", "2", "--capacity", "64", *flags])
        assert code == 2 and out == "" and "Traceback" not in err
        assert "--prompt needs the model's tokenizer, and random weights" in err and "pass --random" not in err
