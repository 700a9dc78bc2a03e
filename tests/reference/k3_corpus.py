"""Corpus and tokenizer for the bundled K3 code model (train_k3.py): the Python sources of installed,
permissively licensed packages, split into train / held-out BY FILE, and a byte-level BPE tokenizer
trained on the train split with HF `tokenizers`, plus its chat template.

Files are found through importlib (find_spec + the distribution's metadata), never by importing the
packages, so the same code runs on any machine; which packages, versions and licenses were used is
returned for the model card. Deterministic for a given set of installed files.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata as md
import importlib.util
import os
import random
import time
import zlib
from pathlib import Path

# (import name, distribution name), in order of preference. All are permissively licensed upstream; the
# license actually recorded is read from the installed distribution's metadata and checked below.
PACKAGES = [
    ("numpy", "numpy"), ("scipy", "scipy"), ("torch", "torch"), ("transformers", "transformers"),
    ("sklearn", "scikit-learn"), ("pandas", "pandas"), ("sympy", "sympy"), ("networkx", "networkx"),
    ("requests", "requests"), ("jinja2", "Jinja2"),
]
PERMISSIVE = ("BSD", "MIT", "Apache", "PSF", "Python Software Foundation", "ISC", "0BSD", "Zlib", "CC0")
NOT_PERMISSIVE = ("GPL",)  # LGPL/AGPL/GPL anywhere in the license string rejects the package
# Directories of vendored third-party code, whose license may differ from the package's: skipped.
SKIP_DIRS = {"_vendor", "vendor", "vendored", "_vendored", "externals", "third_party", "__pycache__"}
MAX_FILE_BYTES = 200_000      # generated tables and giant test files teach little
HELDOUT_PERCENT = 2           # crc32(relative path) % 100 < this -> held-out

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]  # ids 0..3
EOT, IM_START, IM_END, PAD = SPECIAL_TOKENS

# ChatML-style template in the Jinja subset plow renders (src/serve/chat_template.h) and HF renders alike.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


@dataclasses.dataclass
class PackageInfo:
    name: str
    distribution: str
    version: str
    license: str
    files: int = 0
    bytes: int = 0


@dataclasses.dataclass
class Corpus:
    train: list          # [(relative path, text)]
    heldout: list
    packages: list       # [PackageInfo] actually used
    skipped: list        # [(package, reason)]


def license_of(dist: str) -> str:
    meta = md.metadata(dist)
    expr = meta.get("License-Expression")
    if expr:
        return expr.strip()
    classifiers = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    text = (meta.get("License") or "").strip()
    first = text.splitlines()[0].strip() if text else ""
    if first and len(first) <= 80:
        return first + (f" ({'; '.join(classifiers)})" if classifiers else "")
    if classifiers:
        return "; ".join(classifiers)
    return first[:80] or "unknown"


def is_permissive(lic: str) -> bool:
    return any(p.lower() in lic.lower() for p in PERMISSIVE) and not any(b in lic for b in NOT_PERMISSIVE)


def package_files(module: str) -> list[Path]:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for root in spec.submodule_search_locations:
        root = Path(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for f in sorted(filenames):
                if f.endswith(".py"):
                    out.append(Path(dirpath) / f)
    return out


def collect(max_bytes: int, per_package_bytes: int, packages=PACKAGES, log=print) -> Corpus:
    """Reads up to `per_package_bytes` of each available permissive package, `max_bytes` in all.
    Within a package files are taken in a hash order of their relative path (a spread over the tree)."""
    train, heldout, used, skipped = [], [], [], []
    total = 0
    for module, dist in packages:
        if total >= max_bytes:
            break
        try:
            version = md.version(dist)
            lic = license_of(dist)
        except md.PackageNotFoundError:
            skipped.append((dist, "not installed"))
            continue
        if not is_permissive(lic):
            skipped.append((dist, f"license not recognised as permissive: {lic}"))
            continue
        files = package_files(module)
        if not files:
            skipped.append((dist, "no Python sources found"))
            continue
        base = Path(importlib.util.find_spec(module).submodule_search_locations[0]).parent
        files.sort(key=lambda p: zlib.crc32(str(p.relative_to(base)).encode()))
        info = PackageInfo(module, dist, version, lic)
        for p in files:
            if info.bytes >= per_package_bytes or total >= max_bytes:
                break
            try:
                size = p.stat().st_size
                if size == 0 or size > MAX_FILE_BYTES:
                    continue
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            text = text.replace("\r\n", "\n")
            if "\x00" in text or not text.strip():
                continue
            rel = str(p.relative_to(base))
            (heldout if zlib.crc32(rel.encode()) % 100 < HELDOUT_PERCENT else train).append((rel, text))
            info.files += 1
            info.bytes += len(text.encode())
            total += len(text.encode())
        used.append(info)
        log(f"corpus: {dist} {version} ({lic}): {info.files} files, {info.bytes / 1e6:.1f} MB")
    return Corpus(train, heldout, used, skipped)


# -- chat examples: "write a function that <docstring summary>" -> the function --------------------------


def chat_examples(files, max_examples: int, seed: int = 0, max_seconds: float = 20.0) -> list[str]:
    """ChatML conversations built from functions with a docstring: the user asks for the function by
    name, signature and docstring summary; the assistant answers with its source. Teaches the template.
    Stops at max_examples or after max_seconds of parsing."""
    rng = random.Random(seed)
    out = []
    deadline = time.time() + max_seconds
    for _, text in files:
        if len(out) >= max_examples or time.time() > deadline:
            break
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        lines = text.split("\n")
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno is None:
                continue
            summary = doc.strip().split("\n")[0].strip()
            if not (10 <= len(summary) <= 160):
                continue
            src = "\n".join(lines[node.lineno - 1 - len(node.decorator_list): node.end_lineno])
            indent = len(src) - len(src.lstrip(" "))
            src = "\n".join(line[indent:] if line[:indent].strip() == "" else line for line in src.split("\n"))
            if not (80 <= len(src) <= 1500):
                continue
            args = ", ".join(a.arg for a in node.args.args)
            ask = rng.choice(["Write a Python function `{n}({a})`: {s}", "Implement `{n}({a})` in Python. {s}",
                              "{s} Write it as a Python function named `{n}`."]).format(n=node.name, a=args, s=summary)
            out.append(f"{IM_START}user\n{ask}{IM_END}\n{IM_START}assistant\n```python\n{src}\n```{IM_END}\n")
            if len(out) >= max_examples:
                break
    return out


# -- tokenizer ----------------------------------------------------------------------------------------


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer regex, ByteLevel decoder), special tokens at ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, s in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "bos_token": None, "eos_token": EOT, "pad_token": PAD, "unk_token": None,
        "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def encode_documents(tok, docs, eot_id: int):
    """Token ids of docs joined as doc <|endoftext|> doc <|endoftext|> ... (numpy int32)."""
    import numpy as np

    parts = []
    for i in range(0, len(docs), 2000):  # bounded memory: Encoding objects are large
        for e in tok.encode_batch(docs[i:i + 2000], add_special_tokens=False):
            parts.append(np.asarray(e.ids, dtype=np.int32))
            parts.append(np.asarray([eot_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def heldout_slice(tok, files, n_tokens: int):
    """A held-out text of about n_tokens tokens: whole lines from the start of the held-out files (in path
    order), concatenated. Returns (text, the relative paths it came from)."""
    lines_out, used, count = [], [], 0
    for rel, text in sorted(files, key=lambda f: f[0]):
        used.append(rel)
        for line in text.split("\n"):
            piece = line + "\n"
            n = len(tok.encode(piece, add_special_tokens=False).ids)
            if count + n > n_tokens:
                return "".join(lines_out), used
            lines_out.append(piece)
            count += n
    return "".join(lines_out), used
