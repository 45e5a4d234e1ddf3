"""Rebuild a HF `tokenizers` tokenizer.json from a GGUF's `tokenizer.ggml.*` fields.

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and SentencePiece BPE with scores and byte
fallback (`"llama"`, _sentencepiece_tokenizer) are supported. The pre-tokenizer follows
llama.cpp's `pre` name: for "smollm" llama.cpp first isolates every `\\p{N}` and then applies the
GPT-2 regex, which in HF terms is `Digits(individual_digits=True)` then `ByteLevel`. Control
tokens (GGUF type 3, ids 0-16 for SmolLM2) become *special* added tokens, so `encode` maps
"<|im_end|>" to the single id 2 and `decode(skip_special_tokens=...)` knows them; user-defined
tokens (type 4) become normal added tokens. The result round-trips: decode(encode(s)) == s.

Untrusted text must be encoded with specials NOT parsed; that is the frontend's job
(`helios_backend.frontend.tokenizer.FrontendTokenizer.encode_untrusted`).
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ignition.sources.gguf import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    GGUFModel,
    TokenizerFields,
)


SPACE_PIECE = "\u2581"   # SentencePiece's visible space ("▁")


class UnsupportedTokenizerError(Exception):
    """The GGUF tokenizer model or pre-tokenizer has no mapping here."""


# llama.cpp pre-tokenizer names whose behaviour is "split digits individually, then GPT-2 regex".
_DIGITS_THEN_GPT2 = frozenset({"smollm"})
# llama.cpp pre-tokenizer names that are the plain GPT-2 regex.
_GPT2 = frozenset({"gpt2", "default"})
# llama.cpp's "qwen2" pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_QWEN2): contractions, letter runs with one
# leading non-letter, single digits, punctuation runs, newlines; the same regex as the HF
# tokenizer.json of that family, whose Split(isolated) + ByteLevel(use_regex=False) this is.
# HF's NFC normalizer is left out, as llama.cpp does: it would break decode(encode(s)) == s.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_THEN_BYTES = {"qwen2": _QWEN2_SPLIT}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    if pre in _SPLIT_THEN_BYTES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_THEN_BYTES[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    raise UnsupportedTokenizerError(f"pre-tokenizer {pre!r} has no mapping")


def _score_merges(fields: TokenizerFields) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging (llama.cpp's SPM tokenizer
    merges the adjacent pair whose concatenation is the best-scored token): every split of a
    normal token into two normal tokens, ordered by the merged token's score, highest first
    (ties: merged id, then left and right ids; the order of HF's SentencePiece converter).
    Only NORMAL tokens take part, so no merge ever produces a control or user-defined token."""
    normal = {tok: i for i, (tok, kind) in enumerate(zip(fields.tokens, fields.token_types))
              if kind == TOKEN_TYPE_NORMAL}
    found: list[tuple[float, int, int, int, str, str]] = []
    for token, merged in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                found.append((-fields.scores[merged], merged, normal[left], normal[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_tokenizer(fields: TokenizerFields) -> Tokenizer:
    """llama.cpp's "llama" tokenizer model (SentencePiece BPE with scores and byte fallback) in HF
    terms: spaces become U+2581 (and a leading one when the file asks for a space prefix), BPE over
    the score-ordered merges, characters outside the vocabulary as <0xXX> byte tokens; decoding
    reverses each step."""
    if len(fields.scores) != len(fields.tokens):
        raise UnsupportedTokenizerError("a SentencePiece ('llama') tokenizer needs tokenizer.ggml.scores")
    vocab = {tok: i for i, tok in enumerate(fields.tokens)}
    if len(vocab) != len(fields.tokens):
        raise UnsupportedTokenizerError("duplicate token strings in tokenizer.ggml.tokens")
    unk = fields.tokens[fields.unk_id] if fields.unk_id is not None else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=_score_merges(fields), dropout=None, unk_token=unk,
                              fuse_unk=True, byte_fallback=True))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE_PIECE)]
    if fields.add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE_PIECE))
    tk.normalizer = normalizers.Sequence(steps)
    decoding = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if fields.add_space_prefix:
        decoding.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(decoding)
    return tk


def tokenizer_from_fields(fields: TokenizerFields) -> Tokenizer:
    if fields.model == "llama":
        return _with_added_tokens(_sentencepiece_tokenizer(fields), fields)
    if fields.model != "gpt2":
        raise UnsupportedTokenizerError(f"tokenizer model {fields.model!r}; byte-level BPE ('gpt2') or "
                                        "SentencePiece BPE ('llama') only")
    vocab = {tok: i for i, tok in enumerate(fields.tokens)}
    if len(vocab) != len(fields.tokens):
        raise UnsupportedTokenizerError("duplicate token strings in tokenizer.ggml.tokens")
    merges: list[tuple[str, str]] = []
    for merge in fields.merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise UnsupportedTokenizerError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
        merges.append((left, right))
    tk = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tk.pre_tokenizer = _pre_tokenizer(fields.pre)
    tk.decoder = decoders.ByteLevel()
    return _with_added_tokens(tk, fields)


def _with_added_tokens(tk: Tokenizer, fields: TokenizerFields) -> Tokenizer:
    """Control tokens as special added tokens, user-defined ones as normal added tokens (matched
    in the raw text before any other step, as llama.cpp partitions on them)."""
    # Added tokens keep their existing vocab ids because each string is already in the vocab.
    tk.add_special_tokens(
        [AddedToken(fields.tokens[i], special=True, normalized=False) for i in fields.ids_of_type(TOKEN_TYPE_CONTROL)]
    )
    user_defined = fields.ids_of_type(TOKEN_TYPE_USER_DEFINED)
    if user_defined:
        tk.add_tokens([AddedToken(fields.tokens[i], normalized=False) for i in user_defined])
    return tk


def tokenizer_json_from_gguf(model: GGUFModel) -> str:
    """The tokenizer.json text (about 1.5 MB for SmolLM2) for the model's vocabulary."""
    return tokenizer_from_fields(model.tokenizer_fields).to_str()
