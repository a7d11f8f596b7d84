"""In-memory tokenizers for the tiny models (no download, no sentencepiece model file).

Each builds the real transformers tokenizer class from a small vocabulary: CLIP's byte-level
BPE, T5/UMT5's Unigram, Qwen2's byte-level BPE. Prompts tokenize character by character
(there are no merges), which is enough for a tiny model to tell prompts apart.
"""

from __future__ import annotations

import itertools
import string

__all__ = [
    "CHARS",
    "QWEN_SPECIALS",
    "clip_tokenizer",
    "clip_word_tokenizer",
    "qwen2_tokenizer",
    "t5_tokenizer",
    "t5_word_tokenizer",
]

#: printable ASCII without whitespace: byte-level BPE maps these bytes to themselves
CHARS = [c for c in string.printable if not c.isspace()]


def clip_tokenizer(max_length: int = 16, pad_token: str = "<|endoftext|>"):
    """A ``CLIPTokenizer`` (byte-level BPE, ``</w>`` end-of-word suffix) over ASCII chars."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    if pad_token not in vocab:
        vocab[pad_token] = len(vocab)
    for c in CHARS:
        for piece in (c, c + "</w>"):
            if piece not in vocab:
                vocab[piece] = len(vocab)
    tok = CLIPTokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        pad_token=pad_token,
        model_max_length=max_length,
    )
    return tok


def _learn_word_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE training (Sennrich et al. 2016) on ``words`` (each once, ``</w>`` on its last
    character) until every word is one symbol: repeatedly merge the most frequent adjacent
    pair (ties: the first seen). Encoding a training word with these merges, lowest rank
    first, replays its training merges, so each word becomes a single token."""
    seqs = [[*w[:-1], w[-1] + "</w>"] for w in dict.fromkeys(words) if w]
    merges: list[tuple[str, str]] = []
    while any(len(s) > 1 for s in seqs):
        counts: dict[tuple[str, str], int] = {}
        for s in seqs:
            for pair in itertools.pairwise(s):
                counts[pair] = counts.get(pair, 0) + 1
        best = max(counts, key=counts.__getitem__)  # dicts keep first-seen order on ties
        merges.append(best)
        for k, s in enumerate(seqs):
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[k] = out
    return merges


def clip_word_tokenizer(words: list[str], max_length: int = 16):
    """A ``CLIPTokenizer`` in which each of ``words`` (lower-case letters) is one token: the
    ASCII characters of `clip_tokenizer` plus BPE merges learned on ``words``; other text
    still tokenizes (character by character). Pads with ``<|endoftext|>``."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in CHARS:
        for piece in (c, c + "</w>"):
            vocab.setdefault(piece, len(vocab))
    merges = _learn_word_merges(list(words))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=max_length,
    )


def t5_word_tokenizer(words: list[str], max_length: int = 16):
    """A ``T5Tokenizer`` (Unigram) in which each of ``words`` is one piece (``▁word``, scored
    above any split into characters); other text falls back to characters."""
    from transformers import T5Tokenizer

    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for c in CHARS:
        vocab.append((c, -3.0))
        vocab.append(("▁" + c, -3.5))
    known = {v for v, _ in vocab}
    vocab += [("▁" + w, -1.0) for w in dict.fromkeys(words) if "▁" + w not in known]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def t5_tokenizer(max_length: int = 16, extra_ids: int = 0, cls_name: str = "T5Tokenizer"):
    """A T5-family Unigram tokenizer (``T5Tokenizer``; ``cls_name`` picks e.g. a UMT5 alias)."""
    import transformers

    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for c in CHARS:
        vocab.append((c, -3.0))
        vocab.append(("▁" + c, -3.5))
    klass = getattr(transformers, cls_name)
    return klass(vocab=vocab, extra_ids=extra_ids, model_max_length=max_length)


QWEN_SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _word_merges(pre_tokenizer, texts, vocab):
    """BPE merges that make every pre-token of ``texts`` one token (specials excluded)."""
    import re

    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    words: list[str] = []
    for text in texts:
        for part in re.split(r"<\|[a-z_]+\|>", text):
            words += [w for w, _ in pre_tokenizer.pre_tokenize_str(part) if len(w) > 1]
    for w in words:
        cur = w[0]
        for ch in w[1:]:
            if (cur, ch) not in seen:
                seen.add((cur, ch))
                merges.append((cur, ch))
            cur += ch
            vocab.setdefault(cur, len(vocab))
    return merges, words


def qwen2_tokenizer(
    max_length: int = 64, extra_special: tuple[str, ...] = (), words_from: tuple[str, ...] = ()
):
    """A ``Qwen2Tokenizer`` (byte-level BPE over all 256 byte symbols) plus Qwen's chat and
    vision special tokens (``<|im_start|>``, ``<|vision_start|>``, ``<|image_pad|>``...).

    Without ``words_from`` there are no merges (text tokenizes byte by byte). With it, merges
    make each pre-token of those texts (Qwen's own regex split) a single token, so e.g. a
    prompt template tokenizes to as many tokens as with the released vocabulary (whose
    pipelines hard-code the template length)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab["<|endoftext|>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    kw = dict(unk_token="<|endoftext|>", bos_token=None, eos_token="<|im_end|>")
    kw.update(pad_token="<|endoftext|>", model_max_length=max_length)
    if words_from:
        probe = Qwen2Tokenizer(vocab=dict(vocab), merges=[], **kw)
        pre = probe.backend_tokenizer.pre_tokenizer
        merges, words = _word_merges(pre, words_from, vocab)
        # a later word can be split by an earlier word's merges ("Ġuser" vs "user"): join
        # the pieces with extra merges until every word is one token
        for _ in range(4):
            tok = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), **kw)
            model = tok.backend_tokenizer.model
            split = [p for w in words if len(p := [t.value for t in model.tokenize(w)]) > 1]
            if not split:
                break
            for pieces in split:
                cur = pieces[0]
                for nxt in pieces[1:]:
                    if (cur, nxt) not in merges:
                        merges.append((cur, nxt))
                    cur += nxt
                    vocab.setdefault(cur, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, **kw)
    tok.add_special_tokens({"additional_special_tokens": [*QWEN_SPECIALS, *extra_special]})
    return tok
