"""Text in and out of a Llama model: a byte-level BPE tokenizer and its chat template.

Built with the ``tokenizers`` library, from a checkpoint directory's
``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template and the
special tokens), or from a GGUF file's metadata (vocabulary, merges, token
types, pre-tokenizer name and chat template; examples/llama/gguf_model.py).

    tok = Tokenizer.from_directory("path/to/checkpoint")
    ids = tok.chat("What is the capital of France?")     # the chat template applied
    for piece in tok.stream_text(llama.stream(ids, 64)): # text as tokens arrive
        print(piece, end="", flush=True)
"""
from __future__ import annotations

import json
import numbers
from pathlib import Path

import numpy as np

import deviceop as dop

from .config import as_path

# GGUF token types (llama.cpp's llama_token_type): control tokens are special (never
# split by BPE, skipped when decoding for display); user-defined ones are added words.
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

# The GGUF pre-tokenizers served, by ``tokenizer.ggml.pre``: how text is split before BPE.
# GPT-2's regex is ByteLevel's own; SmolLM's splits every digit first; Llama 3's is its own.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt2", "default", "smollm", "llama-bpe")


def _flag(v, name: str) -> bool:
    """A true/false setting, refusing what only looks like one (the string "false" is truthy)."""
    if not isinstance(v, (bool, np.bool_)):
        raise dop.StateError(f"{name}={v!r} must be true or false")
    return bool(v)


def _template(v, name: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise dop.StateError(f"{name} is a {type(v).__name__}, not the text of a Jinja template")
    return v or None


def _directory_template(directory: Path, config: dict) -> str | None:
    """The chat template of a checkpoint directory: ``chat_template.jinja`` (where transformers
    writes it since 4.47), else tokenizer_config.json's ``chat_template``, a string or a list of
    named templates (the one named "default")."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text() or None
        except (OSError, ValueError) as exc:
            raise dop.StateError(f"cannot read {jinja}: {exc}") from None
    v = config.get("chat_template")
    if isinstance(v, list):
        named = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        v = named.get("default")
    return _template(v, "tokenizer_config.json's chat_template")


def _gguf_vocabulary(fields: dict) -> tuple:
    """(tokens, merges as pairs, token types) of a GGUF's tokenizer metadata, each checked:
    the library they go to raises raw errors, or quietly drops what it cannot use."""
    tokens = fields["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise dop.StateError("the GGUF's tokenizer.ggml.tokens must be a non-empty list of strings")
    if len(set(tokens)) != len(tokens):
        first = {}
        dup = next(i for i, t in enumerate(tokens) if first.setdefault(t, i) != i)
        raise dop.StateError(f"the GGUF's token list repeats {tokens[dup]!r} (ids {first[tokens[dup]]} and {dup}): "
                             "a byte-level BPE maps each token to one id; is the file damaged?")
    merges, pairs = fields.get("tokenizer.ggml.merges", []), []
    for m in merges if isinstance(merges, list) else [merges]:
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) and isinstance(merges, list) else ()
        if len(pair) != 2:
            raise dop.StateError(f"the GGUF's tokenizer.ggml.merges holds {m!r}; it is a list of merges, each two "
                                 "tokens separated by a space")
        pairs.append(pair)
    types = fields.get("tokenizer.ggml.token_type")
    if types is None:
        types = [1] * len(tokens)
    if (not isinstance(types, list) or len(types) != len(tokens)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in types)):
        raise dop.StateError(f"the GGUF's tokenizer.ggml.token_type must give an integer type for each of the "
                             f"{len(tokens)} tokens")
    return tokens, pairs, types


def _need_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise dop.StateError("reading a tokenizer needs the tokenizers package: pip install -e '.[llama]'") from None
    return tokenizers


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the model's special ids and chat template."""

    def __init__(self, backend, *, bos_token_id=None, eos_token_ids=(), chat_template: str | None = None,
                 add_bos: bool = False):
        self.backend = backend
        self.bos_token_id, self.eos_token_ids = bos_token_id, tuple(eos_token_ids)
        self.chat_template, self.add_bos = chat_template, add_bos

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """From a GGUF's ``tokenizer.*`` metadata (plain Python values): a GPT-2-style BPE."""
        tk = _need_tokenizers()
        model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre", "default")
        if model != "gpt2":
            raise dop.StateError(f"the GGUF's tokenizer is {model!r}; only byte-level BPE ('gpt2') is read here")
        if pre not in PRE_TOKENIZERS:
            raise dop.StateError(f"the GGUF's pre-tokenizer {pre!r} is not one of {', '.join(PRE_TOKENIZERS)}")
        tokens, merges, types = _gguf_vocabulary(fields)
        try:  # the library raises plain Exceptions (a merge of tokens the vocabulary lacks ...)
            bpe = tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        except Exception as exc:  # noqa: BLE001
            raise dop.StateError(f"the GGUF's tokenizer does not build ({exc}): its token list and merges do not "
                                 "belong together; is the file damaged?") from None
        backend = tk.Tokenizer(bpe)
        byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
        if pre == "smollm":
            backend.pre_tokenizer = tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True),
                                                                byte_level])
        elif pre == "llama-bpe":
            split = tk.pre_tokenizers.Split(tk.Regex(LLAMA3_SPLIT), behavior="isolated")
            backend.pre_tokenizer = tk.pre_tokenizers.Sequence([split, byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = tk.decoders.ByteLevel()
        added = [(tokens[i], t == TOKEN_CONTROL) for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        backend.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s, special in added if special])
        backend.add_tokens([tk.AddedToken(s, special=False, normalized=False) for s, special in added if not special])
        eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if k in fields]
        return cls(backend, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=tuple(dict.fromkeys(eos)),
                   chat_template=_template(fields.get("tokenizer.chat_template"), "the GGUF's tokenizer.chat_template"),
                   add_bos=_flag(fields.get("tokenizer.ggml.add_bos_token", False),
                                 "the GGUF's tokenizer.ggml.add_bos_token"))

    @classmethod
    def from_directory(cls, directory) -> "Tokenizer":
        """From a Hugging Face checkpoint directory: ``tokenizer.json``, and the chat template,
        BOS/EOS tokens and ``add_bos_token`` of ``tokenizer_config.json`` where it exists."""
        tk = _need_tokenizers()
        directory = as_path(directory, "tokenizer directory")
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise dop.StateError(f"{directory} holds no tokenizer.json: pass a checkpoint directory with its "
                                 "tokenizer, or ask for token ids (--tokens)")
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for a malformed file
            raise dop.StateError(f"cannot read the tokenizer {path}: {exc}") from None
        config, where = {}, directory / "tokenizer_config.json"
        if where.is_file():
            try:
                config = json.loads(where.read_text())
            except (OSError, ValueError) as exc:
                raise dop.StateError(f"cannot read {where}: {exc}") from None
            if not isinstance(config, dict):
                raise dop.StateError(f"{where} holds a JSON {type(config).__name__}, not an object of settings: "
                                     "is it a tokenizer_config.json?")

        def token_id(key):
            tok = config.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if tok is None:
                return None
            found = backend.token_to_id(tok) if isinstance(tok, str) else None
            if found is None:
                raise dop.StateError(f"{where.name}'s {key} {tok!r} is not a token of {path.name}: the two files do "
                                     "not belong together")
            return found

        eos = token_id("eos_token")
        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_ids=() if eos is None else (eos,),
                   chat_template=_directory_template(directory, config),
                   add_bos=_flag(config.get("add_bos_token", False), f"{where.name}'s add_bos_token"))

    # -- use ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (added tokens included): all must be rows of the embedding."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a tokenizer that can produce an id the model has no row for."""
        if self.vocab_size > vocab_size:
            raise dop.ShapeError(f"the tokenizer has {self.vocab_size} tokens and the model's vocabulary "
                                 f"{vocab_size}: they do not belong together (wrong tokenizer or config?)")
        for name, ids in (("bos", (self.bos_token_id,) if self.bos_token_id is not None else ()),
                          ("eos", self.eos_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise dop.ShapeError(f"the tokenizer's {name} id {bad[0]} is outside the vocabulary [0, "
                                     f"{vocab_size})")

    def encode(self, text: str) -> list:
        """Token ids of ``text`` (special tokens written in it are recognised), BOS first if the
        model asks for it."""
        if not isinstance(text, str):
            raise dop.DTypeError(f"encode takes text (str), not {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of token ids (ids past the tokenizer's vocabulary, as a padded embedding has, decode
        to nothing)."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise dop.DTypeError(f"decode takes a sequence of token ids, not {type(ids).__name__}")
        ids = list(ids)
        bad = [i for i in ids if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral)
               or not 0 <= i <= np.iinfo(np.uint32).max]
        if bad:
            raise dop.DTypeError(f"decode takes token ids (integers >= 0); got {bad[0]!r}")
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: list) -> str:
        """The chat template applied to ``messages`` ([{"role": ..., "content": ...}]), ending with
        the assistant's turn opened (``add_generation_prompt``)."""
        if not self.chat_template:
            raise dop.StateError("this tokenizer has no chat template: pass --prompt without --chat")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise dop.DTypeError(f"render_chat takes a list of messages, each a dict with a 'role' and its "
                                 f"'content' ([{{'role': 'user', 'content': 'hi'}}]), not {messages!r:.60}")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise dop.StateError("a chat template needs jinja2: pip install -e '.[llama]'") from None

        def raise_exception(message):
            raise dop.StateError(f"the chat template refused the messages: {message}")

        from jinja2 import TemplateError
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders it
        env.globals["raise_exception"] = raise_exception
        token = self.backend.id_to_token
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True,
                bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=token(self.eos_token_ids[0]) if self.eos_token_ids else "")
        except TemplateError as exc:  # a template that does not parse, or reads what is not given to it
            raise dop.StateError(f"the model's chat template cannot be applied ({type(exc).__name__}: {exc}): "
                                 "pass --prompt without --chat, or fix the template") from None

    def chat(self, prompt: str, system: str | None = None) -> list:
        """Token ids of a one-turn chat: the user's ``prompt`` (after an optional ``system`` message)."""
        for name, text in (("prompt", prompt), ("system", "" if system is None else system)):
            if not isinstance(text, str):  # (the template rendered None as the text "None")
                raise dop.DTypeError(f"chat takes text: {name} is {type(text).__name__}, not str")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = self.backend.encode(self.render_chat(messages), add_special_tokens=False).ids
        return ids  # a template that wants BOS writes it itself

    def stream_text(self, ids):
        """Text pieces as ``ids`` arrive: each the new part of the decoded text, held back while it
        ends inside a character (byte-level BPE splits multi-byte characters over tokens)."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise dop.DTypeError(f"stream_text takes an iterable of token ids, not {type(ids).__name__}")
        seen, shown = [], ""
        for i in ids:
            seen.append(i)  # checked by decode (int("a") raised a raw ValueError)
            text = self.decode(seen)
            if text.endswith("\ufffd"):
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
            shown = text
        text = self.decode(seen)
        if len(text) > len(shown):
            yield text[len(shown):]
