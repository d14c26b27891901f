"""The tokenizer (examples/llama/tokenizer.py) given damaged or unusual metadata: a GGUF's
token list, merges, token types, flags and chat template of the wrong kind, a checkpoint
directory's tokenizer_config.json that is not an object or names tokens its tokenizer.json
lacks, and the chat-template places transformers writes.  Each damaged one is a StateError
naming the field (it was a raw TypeError/Exception from the tokenizers library, a jinja2
error, or silently misread); each real layout is read.  And a GGUF tensor the decoder does
not read is named, whatever the tensor count."""
import json
import re
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="the GGUF loader needs the gguf package: pip install -e '.[llama]'")
pytest.importorskip("tokenizers", reason="the tokenizer needs tokenizers: pip install -e '.[llama]'")
pytest.importorskip("jinja2", reason="chat templates need jinja2: pip install -e '.[llama]'")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
from llama.gguf_model import _value, open_gguf  # noqa: E402
from llama.tokenizer import Tokenizer  # noqa: E402
from test_llama_gguf import CFG, CHAT, TOKENS, hf_weights, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def fields(tmp_path_factory):
    """A GGUF's tokenizer.* metadata as open_gguf hands it to the tokenizer."""
    import numpy as np
    path = write_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf", CFG, hf_weights(np.random.default_rng(), CFG))
    reader = gguf.GGUFReader(path)
    return {k: _value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.mark.parametrize("key,value,message", [
    ("tokenizer.ggml.merges", ["nospace"], "merges holds 'nospace'; it is a list of merges, each two tokens"),
    ("tokenizer.ggml.merges", ["zz qq"], "does not build .*Token `zz` out of vocabulary"),
    ("tokenizer.ggml.tokens", list(range(len(TOKENS))), "tokens must be a non-empty list of strings"),
    ("tokenizer.ggml.tokens", TOKENS[:5] + [TOKENS[2]] + TOKENS[6:], re.escape(f"repeats {TOKENS[2]!r} (ids 2 and 5)")),
    ("tokenizer.ggml.token_type", [1, 3], "token_type must give an integer type for each of the"),
    ("tokenizer.ggml.add_bos_token", "false", "add_bos_token='false' must be true or false"),
    ("tokenizer.chat_template", 5, "chat_template is a int, not the text of a Jinja template"),
])
def test_damaged_gguf_tokenizer_metadata_is_a_state_error_naming_the_field(fields, key, value, message):
    with pytest.raises(dop.StateError, match=message):
        Tokenizer.from_gguf_fields({**fields, key: value})


@pytest.mark.parametrize("template,message", [
    ("{% for %}", "chat template cannot be applied \\(TemplateSyntaxError"),
    ("{{ foo.bar }}", "chat template cannot be applied \\(UndefinedError: 'foo' is undefined"),
])
def test_a_chat_template_that_does_not_apply_is_a_state_error(fields, template, message):
    tok = Tokenizer.from_gguf_fields({**fields, "tokenizer.chat_template": template})
    assert tok.encode("hello") == Tokenizer.from_gguf_fields(fields).encode("hello")  # text without --chat works
    with pytest.raises(dop.StateError, match=message):
        tok.chat("hi")


def test_a_damaged_tokenizer_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    import numpy as np
    allocated = []
    monkeypatch.setattr(type(dop.Device(0)), "alloc", lambda self, *a, **k: allocated.append(a))
    original = gguf.GGUFWriter.add_token_merges
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_merges", lambda self, merges: original(self, ["nospace"]))
    path = write_gguf(tmp_path / "m.gguf", CFG, hf_weights(np.random.default_rng(), CFG))
    with pytest.raises(dop.StateError, match="merges holds 'nospace'"):
        open_gguf(path)
    assert allocated == []


@pytest.fixture
def directory(tmp_path, fields):
    Tokenizer.from_gguf_fields(fields).backend.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_transformers_chat_template_places_are_read(directory, fields):
    """chat_template.jinja (transformers >= 4.47 writes it there) and a list of named
    templates were read as no template: --chat said the model has none."""
    want = Tokenizer.from_gguf_fields(fields).chat("hi")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHAT}]}))
    assert Tokenizer.from_directory(directory).chat("hi") == want
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "chat_template.jinja").write_text(CHAT)
    assert Tokenizer.from_directory(directory).chat("hi") == want


@pytest.mark.parametrize("config,message", [
    ([1, 2], "holds a JSON list, not an object of settings"),
    ({"add_bos_token": "false"}, "add_bos_token='false' must be true or false"),
    ({"eos_token": "</nonexistent>"}, "eos_token '</nonexistent>' is not a token of tokenizer.json"),
    ({"bos_token": {"content": "<nope>"}}, "bos_token '<nope>' is not a token of tokenizer.json"),
])
def test_a_tokenizer_config_that_does_not_fit_is_a_state_error_naming_it(directory, config, message):
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(dop.StateError, match=message):
        Tokenizer.from_directory(directory)


@pytest.mark.parametrize("ids,message", [([-1], "got -1"), ("abc", "not str"), ([1.5], "got 1.5"), (7, "not int")])
def test_decode_refuses_what_is_not_token_ids(fields, ids, message):
    with pytest.raises(dop.DTypeError, match=message):
        Tokenizer.from_gguf_fields(fields).decode(ids)


def test_a_tensor_the_decoder_does_not_read_is_named_even_when_the_count_differs(tmp_path, monkeypatch):
    """A Llama 3 GGUF holds rope_freqs.weight (its RoPE scaling, which this loader does not
    serve): it was refused as 'the file and its metadata do not belong together'."""
    import numpy as np
    path = write_gguf(tmp_path / "llama3.gguf", CFG, hf_weights(np.random.default_rng(), CFG),
                      extra=[("rope_freqs.weight", np.ones(CFG.head_dim // 2, np.float32))])
    with pytest.raises(dop.StateError, match="holds a tensor 'rope_freqs.weight' that a Llama decoder of 2 layers "
                                             "does not read .*llama3 rope_freqs"):
        open_gguf(path)


@pytest.mark.parametrize("meta,message", [
    ({"llama.attention.key_length": 128}, "llama.rope.dimension_count=64 differs from its head dimension 128"),
    ({"llama.attention.value_length": 32}, "llama.attention.value_length=32 differs from its head dimension 64"),
])
def test_a_partial_rotary_or_a_value_width_of_its_own_is_refused(tmp_path, meta, message):
    """Heads of 128 with 64 rotary dimensions were read as a full rotary (RoPE on every pair:
    other arithmetic, silently); a value_length of its own was ignored."""
    import numpy as np
    path = write_gguf(tmp_path / "p.gguf", CFG, hf_weights(np.random.default_rng(), CFG), meta=meta)
    with pytest.raises(dop.StateError, match=f"the GGUF's {message}"):
        open_gguf(path)


def test_metadata_text_that_is_not_utf8_is_a_state_error(tmp_path):
    """A damaged byte in a metadata string raised gguf's raw UnicodeDecodeError (byte flips in
    the header: 29 of 400 files)."""
    import numpy as np
    data = bytearray(write_gguf(tmp_path / "t.gguf", CFG, hf_weights(np.random.default_rng(), CFG)).read_bytes())
    at = data.index(b"{% for m in messages %}")
    data[at] = 0xFF
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(dop.StateError, match="metadata tokenizer.chat_template holds text that is not UTF-8"):
        open_gguf(tmp_path / "bad.gguf")


@pytest.mark.parametrize("call,message", [
    (lambda tok: tok.chat(None), "chat takes text: prompt is NoneType, not str"),   # rendered as the text "None"
    (lambda tok: tok.chat(["hi"]), "prompt is list, not str"),                      # rendered as "['hi']"
    (lambda tok: tok.chat("hi", system=3), "system is int, not str"),
    (lambda tok: tok.render_chat("hi"), "render_chat takes a list of messages"),     # each character a message
    (lambda tok: tok.render_chat([{"content": "hi"}]), "each a dict with a 'role'"),
    (lambda tok: list(tok.stream_text("ab")), "stream_text takes an iterable of token ids, not str"),
    (lambda tok: list(tok.stream_text([40, "a"])), "decode takes token ids .* got 'a'"),  # a raw ValueError
])
def test_chat_and_streamed_text_refuse_what_is_not_text_or_ids(fields, call, message):
    tok = Tokenizer.from_gguf_fields(fields)
    with pytest.raises(dop.DTypeError, match=message):
        call(tok)
    assert "".join(tok.stream_text(tok.encode("hello"))) == tok.decode(tok.encode("hello"))
    assert tok.chat("hi", system="be brief") == tok.encode(tok.render_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
