#!/usr/bin/env python3
"""Write tests/data/eval-ppl/: a short text and the float64 k3_reference perplexity of it under
tests/data/tiny-k3 with the byte-level tokenizer of tests/data/tiny-kimi-linear-chat (vocab 256, so it
fits tiny-k3). tests/unit/eval_ppl_test.cpp holds `plow eval-ppl` to these numbers.

    python tests/reference/make_eval_ppl_fixture.py      # ~5 s, CPU; needs torch, safetensors, tokenizers
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k3_reference import K3Reference, load_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
TEXT = ("def mean(xs):\n    \"\"\"Arithmetic mean of a non-empty list.\"\"\"\n    return sum(xs) / len(xs)\n\n\n"
        "for k in range(3):\n    print(k, mean([k, k + 1]))  # 0.5, 1.5, 2.5\n")
PREFIX_TOKENS = 40   # also recorded: the first 40 tokens only (--max-tokens 40)


def main():
    out = DATA / "eval-ppl"
    out.mkdir(exist_ok=True)
    (out / "text.txt").write_text(TEXT)
    ids = Tokenizer.from_file(str(DATA / "tiny-kimi-linear-chat" / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    cfg, weights = load_checkpoint(DATA / "tiny-k3")
    assert max(ids) < cfg.vocab_size
    logits = K3Reference(cfg, weights, dtype=torch.float64).forward(ids)
    per = F.cross_entropy(logits[:-1], torch.as_tensor(ids[1:]), reduction="none")
    nll, nll_prefix = float(per.mean()), float(per[: PREFIX_TOKENS - 1].mean())
    expected = {
        "model": "tests/data/tiny-k3", "tokenizer": "tests/data/tiny-kimi-linear-chat/tokenizer.json",
        "text_file": "tests/data/eval-ppl/text.txt", "reference": "tests/reference/k3_reference.py, float64",
        "tokens": len(ids), "predicted_tokens": len(ids) - 1, "nll": nll, "ppl": math.exp(nll),
        "prefix": {"max_tokens": PREFIX_TOKENS, "nll": nll_prefix, "ppl": math.exp(nll_prefix)},
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main()
