"""Build the real fleet's model offline: a tiny Llama with random weights and a word-piece tokenizer.

Run with the real fleet's interpreter (it needs torch, transformers and tokenizers, which only the vLLM
environment has): `.venv-vllm/bin/python -m grayguard.localstack.vllm_model --out DIR`. No hub is reached: the
configuration, the weights (seeded) and the vocabulary are all made here, in a few seconds.

The vocabulary keeps the two prompts the project sends one token a word: the load generator's three-letter words
(sim/loadgen.py PROMPT_WORDS: N words, N prompt tokens, as the simulator counts them) and the probe's "The capital
of France is". Any other word falls apart into its characters (`##` pieces), so the probe's random hex prefix
gives every probe a prompt of its own, as on a real tokenizer (no prefix-cache hit).

This module imports nothing of the project: the vLLM environment does not install grayguard.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import string
import sys
from pathlib import Path

# What the fleet and its tests rely on; the numbers are small so that 3-4 instances fit 2 CPU cores.
MODEL_NAME = "grayguard/tiny-llama-random"
HIDDEN, LAYERS, HEADS, INTERMEDIATE = 128, 2, 2, 256
MAX_POSITIONS = 8192
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>"]
WORDS = """lor the capital of france is a an and or to in on at for with by from as it this that be are was
were not no yes one two three four five six seven eight nine ten model token request fleet node
gray failure latency fast slow good bad hello world question answer paris city country"""
# Tokens the model never produces: special ones decode to "" (the probe would call an empty answer a bad response)
# and a run of "!" is what the load generator counts as garbage (sim/loadgen.py looks_garbage). Their rows of the
# output layer are zero, so their logit is 0 while the largest of the others is almost surely above it.
NEVER_OUTPUT = (*SPECIALS, "!", "##!")
STAMP = "grayguard-model.json"  # what was built, so a fleet can tell a stale build (and the version) apart


# sim/loadgen.py's PROMPT_WORDS, made the same way here (this module imports nothing of the project; a test checks)
PROMPT_WORDS = [a + b + c for a in "bdfgklmnprstvz" for b in "aeiou" for c in "bdfgklmnprstvz"]


def vocabulary() -> list[str]:
    """Special tokens, the words above and the prompt words, then every printable character alone and as a
    continuation piece."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    out = list(SPECIALS)
    for tok in [*WORDS.split(), *PROMPT_WORDS, *chars, *(f"##{c}" for c in chars)]:
        if tok not in out:
            out.append(tok)
    return out


def fingerprint() -> str:
    """What a build depends on (the vocabulary, the tokens never emitted, the shape): a stamp with another
    fingerprint is a stale build, made before this module changed."""
    text = json.dumps([vocabulary(), list(NEVER_OUTPUT), HIDDEN, LAYERS, HEADS, INTERMEDIATE, MAX_POSITIONS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_tokenizer(out: Path):
    """A lower-casing word-piece tokenizer over vocabulary(), saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]",
                                   pad_token="[PAD]", model_max_length=MAX_POSITIONS)
    fast.save_pretrained(out)
    return fast


def build(out: Path, seed: int = 0) -> Path:
    """Write config, weights (safetensors) and tokenizer to out; returns out."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      max_position_embeddings=MAX_POSITIONS, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, torch_dtype="bfloat16",
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for tok in NEVER_OUTPUT:
            model.lm_head.weight[fast.convert_tokens_to_ids(tok)] = 0
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    (out / STAMP).write_text(json.dumps({"name": MODEL_NAME, "fingerprint": fingerprint(), "seed": seed,
                                         "parameters": params,
                                         "hidden": HIDDEN, "layers": LAYERS, "vocab": len(fast)}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grayguard.localstack.vllm_model",
                                description="Build the real fleet's tiny random-weight Llama offline (no hub).")
    p.add_argument("--out", type=Path, required=True, help="the model folder to write (created)")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the random weights (default 0)")
    args = p.parse_args(argv)
    path = build(args.out, args.seed)
    print(json.loads((path / STAMP).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
