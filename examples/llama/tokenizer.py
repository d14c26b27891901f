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
from pathlib import Path

import deviceop as dop

# GGUF token types (llama.cpp's llama_token_type): control tokens are special (never
# split by BPE, skipped when decoding for display); user-defined ones are added words.
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

# The GGUF pre-tokenizers served, by ``tokenizer.ggml.pre``: how text is split before BPE.
# GPT-2's regex is ByteLevel's own; SmolLM's splits every digit first; Llama 3's is its own.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt2", "default", "smollm", "llama-bpe")


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
        tokens, merges = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.merges", [])
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        bpe = tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                            merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
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
                   eos_token_ids=tuple(dict.fromkeys(eos)), chat_template=fields.get("tokenizer.chat_template"),
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_directory(cls, directory) -> "Tokenizer":
        """From a Hugging Face checkpoint directory: ``tokenizer.json``, and the chat template,
        BOS/EOS tokens and ``add_bos_token`` of ``tokenizer_config.json`` where it exists."""
        tk = _need_tokenizers()
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise dop.StateError(f"{directory} holds no tokenizer.json: pass a checkpoint directory with its "
                                 "tokenizer, or ask for token ids (--tokens)")
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for a malformed file
            raise dop.StateError(f"cannot read the tokenizer {path}: {exc}") from None
        config = {}
        if (directory / "tokenizer_config.json").is_file():
            try:
                config = json.loads((directory / "tokenizer_config.json").read_text())
            except (OSError, ValueError) as exc:
                raise dop.StateError(f"cannot read {directory / 'tokenizer_config.json'}: {exc}") from None

        def token_id(key):
            tok = config.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        eos = token_id("eos_token")
        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_ids=() if eos is None else (eos,),
                   chat_template=config.get("chat_template") if isinstance(config.get("chat_template"), str)
                   else None, add_bos=bool(config.get("add_bos_token", False)))

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
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: list) -> str:
        """The chat template applied to ``messages`` ([{"role": ..., "content": ...}]), ending with
        the assistant's turn opened (``add_generation_prompt``)."""
        if not self.chat_template:
            raise dop.StateError("this tokenizer has no chat template: pass --prompt without --chat")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise dop.StateError("a chat template needs jinja2: pip install -e '.[llama]'") from None

        def raise_exception(message):
            raise dop.StateError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        token = self.backend.id_to_token
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=token(self.eos_token_ids[0]) if self.eos_token_ids else "")

    def chat(self, prompt: str, system: str | None = None) -> list:
        """Token ids of a one-turn chat: the user's ``prompt`` (after an optional ``system`` message)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = self.backend.encode(self.render_chat(messages), add_special_tokens=False).ids
        return ids  # a template that wants BOS writes it itself

    def stream_text(self, ids):
        """Text pieces as ``ids`` arrive: each the new part of the decoded text, held back while it
        ends inside a character (byte-level BPE splits multi-byte characters over tokens)."""
        seen, shown = [], ""
        for i in ids:
            seen.append(int(i))
            text = self.decode(seen)
            if text.endswith("\ufffd"):
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
            shown = text
        text = self.decode(seen)
        if len(text) > len(shown):
            yield text[len(shown):]
