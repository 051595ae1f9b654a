"""Tokenizers built in memory, for the tiny models and the config-only full-size checkpoints (no hub):
byte- or character-level CLIP, T5, Gemma and Qwen2 tokenizers with the special tokens of their families;
`edit_tokenizer` spells Qwen-Image-Edit's prompt template as the real tokenizer does, `qwen_bpe_tokenizer`
is the real Qwen2 tokenizer built from Qwen's BPE ranks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast


def clip_tokenizer():
    """A byte-level CLIP BPE with no merges: one token per character, the last one of a word with `</w>`."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level symbols
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({c + "</w>": 256 + i for i, c in enumerate(alphabet)})
    vocab["<|startoftext|>"] = 512
    vocab["<|endoftext|>"] = 513
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer(model_max_length: int):
    """A character-level Unigram T5 tokenizer (printable ASCII) built from a (piece, score) list."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(i), -5.0) for i in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def qwen_image_tokenizer():
    """A byte-level Qwen2 BPE whose only merges spell the words of Qwen-Image's prompt template, so the
    template prefix is 34 tokens as with the real tokenizer (the pipeline drops exactly 34) and a prompt
    costs about one token per byte."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    words = ["system", "user", "assistant", "Describe"]
    words += ["\u0120" + w for w in "the image by detailing color shape size texture quantity text".split()]
    words += [
        "\u0120" + w for w in "spatial relationships of objects and background".split()
    ]  # \u0120: a space
    merges = []
    for word in words:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                merges.append((word[: i - 1], word[i - 1]))
                vocab[word[:i]] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    specials += ["<|image_pad|>", "<|video_pad|>"]
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tokenizer


def gemma_tokenizer(model_max_length: int = 16):
    """A character-level Gemma tokenizer (printable ASCII and the word-start mark), built in memory."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for i in range(32, 127):
        vocab[chr(i)] = len(vocab)
    vocab["\u2581"] = len(vocab)
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


# The special tokens `edit_tokenizer` adds after its byte-level vocabulary (Qwen2's that the pipeline uses).
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
]  # fmt: skip


def _bpe(piece: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """`piece` split into the tokens of a byte-level BPE with merge `ranks` (lowest rank merged first)."""
    parts = list(piece)
    while len(parts) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def edit_tokenizer():
    """A byte-level Qwen2 BPE that spells every word and mark of Qwen-Image-Edit's prompt template as one
    token, as the real tokenizer does: the template's prefix is then 64 tokens, exactly what the edit
    pipeline drops (`prompt_template_encode_start_idx`), so a prompt's text length is the real one's (the
    condition image's vision tokens plus the instruction at about one token per byte plus a few template
    tokens). The tiny tokenizers would leave ~150 template tokens in every text (tiny.py's edit one has no
    merges at all), past the recipe's largest prompt-length bucket."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    # The installed pipeline's own template (a pipeline of no modules only sets its fields).
    none: dict[str, Any] = dict.fromkeys(
        ["scheduler", "vae", "text_encoder", "tokenizer", "processor", "transformer"]
    )
    template = QwenImageEditPipeline(**none).prompt_template_encode
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    pre = Qwen2Tokenizer(vocab=dict(vocab), merges=[]).backend_tokenizer.pre_tokenizer
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for chunk in re.split(r"<\|[a-z_]+\|>|\{\}", template):
        for piece, _ in pre.pre_tokenize_str(chunk):
            parts = _bpe(piece, ranks)
            while len(parts) > 1:  # merge what the earlier merges left, left to right
                pair = (parts[0], parts[1])
                ranks[pair] = len(merges)
                merges.append(pair)
                vocab.setdefault(pair[0] + pair[1], len(vocab))
                parts[:2] = [pair[0] + pair[1]]
    vocab.update({s: len(vocab) + i for i, s in enumerate(QWEN_SPECIALS)})
    # transformers annotates `merges` as strings; tokenizers' BPE, which it passes them to, takes pairs.
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=cast(Any, merges), pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    return tokenizer


# Qwen2's special tokens from id 151643 on, in order (the real tokenizer_config.json of Qwen2.5-VL): the ids
# the text encoder config names (image_token_id 151655 and so on) are then the tokenizer's own.
QWEN2_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip


def qwen_bpe_tokenizer(ranks_file: str | Path):
    """The real Qwen2 tokenizer (Qwen2.5-VL's, the one Qwen-Image's pipelines use), built offline from the
    byte-level BPE ranks of Qwen's `qwen.tiktoken` (151,643 tokens; Qwen2 kept Qwen's vocabulary), which the
    `dashscope` wheel ships in `dashscope/resources/`. Prompt lengths then are the real ones: the tiny
    byte-level tokenizers spend a token per byte, several times the real count for English prompts, which
    inflates every text row and misleads the choice of prompt-length buckets.

    The merges are derived from the ranks as transformers' `TikTokenConverter` derives them (every split of
    a token into two tokens, in rank order). Checked against `tiktoken` itself with the Qwen2 pre-tokenizer
    pattern on the benchmark's prompts, the OCR prompt set, digits, punctuation and non-Latin scripts: equal
    ids (benchmarks/RESULTS.md)."""
    import base64

    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks: dict[bytes, int] = {}
    for line in Path(ranks_file).read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    single = sum(len(t) == 1 for t in ranks)
    if sorted(ranks.values()) != list(range(len(ranks))) or single != 256:
        raise ValueError(
            f"{ranks_file}: not byte-level BPE ranks (need ranks 0..n-1 and all 256 single bytes, got "
            f"{len(ranks)} ranks, {single} single bytes); Qwen's qwen.tiktoken has 151643 ranks"
        )
    byte_char = bytes_to_unicode()  # the byte-level alphabet: byte -> printable character

    def spell(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    merges = []  # (rank of the merged token, left, right)
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = sorted((ranks[l], ranks[r], l, r) for l, r in splits if l in ranks and r in ranks)
        merges += [(rank, l, r) for _, _, l, r in splits]
    merges.sort(key=lambda m: m[0])
    vocab = {spell(t): r for t, r in ranks.items()}
    vocab.update({s: len(ranks) + i for i, s in enumerate(QWEN2_SPECIALS)})
    pairs = [(spell(l), spell(r)) for _, l, r in merges]  # pairs, as tokenizers' BPE takes them (see above)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=cast(Any, pairs), pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_SPECIALS[1:]})
    return tokenizer
