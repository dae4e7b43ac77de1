"""A transformers tokenizer as GGUF metadata: vocabulary, merges, token types, special ids, chat template.

Two tokenizer models, read from the fast tokenizer's ``tokenizer.json`` form:
- byte-level BPE (GPT-2 style: Llama 3, Qwen 2/3, SmolLM, Mistral Nemo's tekken, nbkit's demo tokenizer) ->
  ``tokenizer.ggml.model = "gpt2"``: tokens spelled in the byte alphabet, the merges, and the pre-tokenizer's name
  (``tokenizer.ggml.pre``), which llama.cpp needs to split text the way the merges were learned. The name comes
  from llama.cpp's fingerprint (the token ids of a fixed probe text, hashed; a few known values below), else from
  the pre-tokenizer's structure and split pattern (the patterns transformers' GGUF reader uses); else "default",
  with a warning (llama.cpp then splits differently);
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral 7B, Gemma) -> ``"llama"``: tokens with "▁" for
  spaces, ``<0xXX>`` byte tokens, scores from the merge order (llama.cpp merges by score), the merges too (the
  transformers reader rebuilds from them), and whether a space is prefixed.
Token types: added special tokens are CONTROL, other added tokens USER_DEFINED, byte tokens BYTE, the unknown
token UNKNOWN, ids the tokenizer lacks below the model's vocabulary size ``[PAD<i>]`` UNUSED. Special ids: bos,
eos, unk, pad, and the chat template's end-of-turn token as ``eot`` (llama.cpp stops on it).
Not covered: Unigram (T5-style) and WordPiece vocabularies.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import numpy as np

from ..reliability.stop_token import end_of_turn_token

logger = logging.getLogger(__name__)

# llama.cpp's probe text for pre-tokenizer fingerprints (convert_hf_to_gguf.py, get_vocab_base_pre)
PROBE = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на "
    "Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make "
    "it, 'D you like some tea? We'Ve a'lL"
)
KNOWN_FINGERPRINTS = {  # sha256 of str(token ids of PROBE) -> llama.cpp pre-tokenizer name
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen 1.5 / 2 / 2.5 / 3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3 embedding
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
}
PREFERRED = ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35", "smaug-bpe")
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def _backend(tokenizer: Any) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise NotImplementedError("GGUF export needs a fast (tokenizers-backed) tokenizer")
    return json.loads(backend.to_str())


def _parts(node: dict | None) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [p for sub in node.get("pretokenizers") or node.get("normalizers") or node.get("decoders") or []
                for p in _parts(sub)]
    return [node]


def _byte_level(spec: dict) -> bool:
    return any(p.get("type") == "ByteLevel" for p in _parts(spec.get("pre_tokenizer")) + _parts(spec.get("decoder")))


def pre_tokenizer_name(tokenizer: Any, spec: dict) -> tuple[str, str]:
    """(llama.cpp pre-tokenizer name, how it was found) for a byte-level BPE tokenizer."""
    fingerprint = hashlib.sha256(str(tokenizer.encode(PROBE, verbose=False)).encode()).hexdigest()  # no length warning
    if fingerprint in KNOWN_FINGERPRINTS:
        return KNOWN_FINGERPRINTS[fingerprint], "llama.cpp fingerprint"
    parts = _parts(spec.get("pre_tokenizer"))
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2", "pre-tokenizer structure (GPT-2 split)"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm", "pre-tokenizer structure (single digits, then GPT-2 split)"
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(splits) == 1 and kinds[-1] == "ByteLevel":
        pattern = (splits[0].get("pattern") or {}).get("Regex")
        try:
            from ..trl_seam import GGUF_PRE_TOKENIZER_SPLITS as known
        except ImportError:
            known = {}
        names = [n for n, regex in known.items() if regex == pattern]
        if names:
            best = next((n for n in PREFERRED if n in names), names[0])
            return best, "split pattern"
    logger.warning("nbkit export: this tokenizer's pre-tokenizer is not one llama.cpp knows by name; written as "
                   "'default' (llama.cpp will split text differently from transformers)")
    return "default", "unknown (default)"


def _merges(spec: dict) -> list[str]:
    merges = spec["model"].get("merges") or []
    out = []
    for merge in merges:
        if isinstance(merge, str):
            out.append(merge)
        else:  # [left, right]; a space inside a part is written as U+0120-shifted, as llama.cpp's converter does
            out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in merge))
    return out


def write_vocab(writer: Any, tokenizer: Any, vocab_size: int) -> dict:
    """Write the tokenizer's metadata to ``writer``; returns what was decided (model, pre-tokenizer, ids)."""
    spec = _backend(tokenizer)
    if spec["model"].get("type") != "BPE":
        raise NotImplementedError(f"GGUF export covers BPE tokenizers; not {spec['model'].get('type')}")
    byte_level = _byte_level(spec)
    spm = not byte_level and bool(spec["model"].get("byte_fallback"))
    if not (byte_level or spm):
        raise NotImplementedError("GGUF export covers byte-level BPE and SentencePiece-style BPE (byte fallback)")
    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(by_id)}, the model's vocabulary is {vocab_size}")
    added = {i: tok for i, tok in tokenizer.added_tokens_decoder.items()}
    merges = _merges(spec)
    rank = {m.replace(" ", ""): r for r, m in enumerate(merges)}
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
            scores.append(-1e4)
            continue
        if i in added:
            kind = TOKEN_CONTROL if added[i].special else TOKEN_USER
            if spm and kind == TOKEN_USER:
                text = text.replace("\u2581", " ")
        elif i == tokenizer.unk_token_id:
            kind = TOKEN_UNKNOWN
        elif spm and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            kind = TOKEN_BYTE
        else:
            kind = TOKEN_NORMAL
        tokens.append(text)
        types.append(kind)
        scores.append(-float(rank[text]) - 1.0 if text in rank and kind == TOKEN_NORMAL else 0.0)
    writer.add_tokenizer_model("gpt2" if byte_level else "llama")
    if byte_level:
        pre, how = pre_tokenizer_name(tokenizer, spec)
    else:
        pre, how = "default", "SentencePiece"
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if spm:
        writer.add_token_scores([float(np.float32(x)) for x in scores])
        normal = _parts(spec.get("normalizer")) + _parts(spec.get("pre_tokenizer"))
        prefix = any((p.get("type") == "Prepend" and p.get("prepend") == "\u2581")
                     or (p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never")
                     for p in normal)
        writer.add_add_space_prefix(prefix)
    if merges:
        writer.add_token_merges(merges)
    ids = {}
    for kind in ("bos", "eos", "unk", "pad"):
        value = getattr(tokenizer, f"{kind}_token_id", None)
        if isinstance(value, int):
            getattr(writer, f"add_{kind}_token_id")(value)
            ids[kind] = value
    eot = end_of_turn_token(tokenizer)
    if eot is not None and eot in vocab:
        writer.add_eot_token_id(vocab[eot])
        ids["eot"] = vocab[eot]
    probe = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(bool(probe) and probe[0] == getattr(tokenizer, "bos_token_id", None))
    writer.add_add_eos_token(bool(probe) and probe[-1] == getattr(tokenizer, "eos_token_id", None) and len(probe) > 1)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)
    return {"model": "gpt2" if byte_level else "llama", "pre": pre, "pre_from": how, "ids": ids,
            "tokens": len(tokens), "merges": len(merges)}
