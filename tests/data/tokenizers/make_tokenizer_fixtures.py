#!/usr/bin/env python3
"""Writes the tokenizer fixtures and the expected ids that tests/unit/tokenizer_test.cpp checks plow against.

The oracles are the reference libraries themselves: HF `tokenizers` for tokenizer.json (every fixture and
every variant patch below), and OpenAI `tiktoken` wrapped the way Kimi's tokenization_kimi.py wraps it for
the tiktoken.model fixture. CI never runs this script; it only reads the committed expected.json.

Run: /work/pyenv/bin/python tests/data/tokenizers/make_tokenizer_fixtures.py   (tokenizers>=0.20, tiktoken)
"""
import base64
import copy
import json
import sys
import unicodedata
from pathlib import Path

import regex
import tiktoken
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parent
VOCAB_SIZE = 3000
SPECIALS = ["[BOS]", "[EOS]", "<|im_start|>", "<|im_end|>"]
NON_SPECIAL = "<think>"

# Llama-3 style split; the same pattern GPT-4's cl100k uses.
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenization_kimi.py (Kimi K2 / Kimi Linear), verbatim.
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_RESERVED = 256  # TikTokenTokenizer.num_reserved_special_tokens
LONG_CHARS = 1000  # corpus strings longer than this are checked only on the fixtures in WITH_LONG_STRINGS
WITH_LONG_STRINGS = {"hf_merges_pairs", "kimi_split", "kimi_tiktoken"}

# Multilingual training text written for this fixture (no third-party text besides the Python stdlib).
MULTILINGUAL = """
The quick brown fox jumps over the lazy dog. It's a tokenizer test, isn't it? We'll see, they've said.
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Übermaß, Straße.
Le vif renard brun saute par-dessus le chien paresseux. Élève, façade, garçon, où est-ce?
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca? ¡Olé!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир! Ещё раз.
Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Καλημέρα κόσμε.
敏捷的棕色狐狸跳过了懒狗。你好，世界！这是一个分词器的测试。中文和English混合。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界！カタカナとひらがな。
빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 안녕하세요, 세계!
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم.
השועל החום המהיר קופץ מעל הכלב העצלן. שלום עולם.
तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है। नमस्ते दुनिया।
สุนัขจิ้งจอกสีน้ำตาลกระโดดข้ามสุนัขขี้เกียจ สวัสดีชาวโลก
Con cáo nâu nhanh nhẹn nhảy qua con chó lười. Tiếng Việt có dấu.
Emoji: 😀 😂 👍🏽 👨‍👩‍👧‍👦 🇯🇵 🇩🇪 ❤️ 🔥 ✨ 1️⃣
Numbers: 0 1 12 123 1234 12345 3.14159 2,718 1e-9 0x1F ٣٤٥ ①②③ Ⅻ
"""


def training_corpus():
    files = sorted(Path("/usr/lib/python3.11").glob("*.py"))
    texts, total = [], 0
    for f in files:
        t = f.read_text(encoding="utf-8", errors="ignore")
        texts.append(t)
        total += len(t)
        if total > 4_000_000:
            break
    texts.extend([MULTILINGUAL] * 200)
    return texts


def train():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(NON_SPECIAL, special=False, normalized=True)])
    return json.loads(tok.to_str())


def corpus():
    """The test strings. A dict entry {"repeat", "count", "suffix"} stands for a long string."""
    return [
        "", " ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \t \n ", "   \r\n\r\n  \t",
        "Hello", "Hello, world!", "hello world", " leading space", "trailing space ", "trailing spaces   ",
        "multiple   spaces   between", "tab\tseparated\tvalues", "line one\nline two\r\nline three\n",
        "I'm you're he'll she'd we've they're it's IT'S DON'T 'S 'T", "it'ſ a Kelvin K", "rock'n'roll",
        "CamelCaseWord XMLHttpRequest ABCdef abcDEF iPhone McDonald's", "ALLCAPS lowercase Titlecase ǅungla",
        "The quick brown fox jumps over the lazy dog.",
        "Größe Übermaß Straße façade garçon où", "e\u0301 vs \u00e9 (combining acute vs precomposed)",
        "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307l\u036e\u0312\u036bg\u030c\u0317\u035a o",
        "Привет, мир! Ёжик в тумане.", "Καλημέρα κόσμε, ΑΒΓ αβγ",
        "你好，世界！这是一个测试。", "中文English混合text和数字123", "「引用」『二重』（括弧）、。〜ー", "々〆〇 ㈱ ⺀ 𠀀𠀁",
        "こんにちは、世界！カタカナとひらがな、漢字。", "안녕하세요, 세계! 한국어 텍스트",
        "مرحبا بالعالم، هذا اختبار.", "שָׁלוֹם עוֹלָם, זה מבחן", "English then العربية then עברית mixed",
        "नमस्ते दुनिया।", "สวัสดีชาวโลก", "Tiếng Việt có dấu: Nguyễn, Hà Nội",
        "😀😂🤣", "👍 👍🏻 👍🏽 👍🏿", "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag", "🇯🇵🇩🇪🇺🇸", "1️⃣ #️⃣ ©️ ™",
        "❤️‍🔥 text after emoji", "emoji🔥inside✨words",
        "0", "42", "1234567890", "3.14159 2,718 1e-9 -17 +3", "0x1F 0b1010 0o777", "٣٤٥ ۱۲۳ १२३ ①②③ Ⅻ ½",
        "2024-06-01T12:34:56Z", "$1,000,000.00 and €5 or £3 ¥100",
        "def f(x):\n    return x ** 2  # square\n",
        "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "fn main() -> Result<(), Box<dyn Error>> {\n    println!(\"{}\", 1);\n    Ok(())\n}",
        "const x = (a, b) => a?.b ?? `tmpl ${b}`;", "<div class=\"x\">&amp; &lt;</div>",
        "SELECT * FROM t WHERE a >= 10 AND b <> 'x';", "{\"key\": [1, 2.5, null, true], \"k2\": {}}",
        "#!/bin/bash\nfor f in *.txt; do echo \"$f\" | grep -v '^#'; done",
        "std::vector<std::pair<int, float>> v{{1, 2.0f}};",
        "\u00a0non-breaking\u00a0space", "ideographic\u3000space", "mongolian\u180evowel sep",
        "line\u2028separator\u2029paragraph", "zero\u200bwidth\u200djoiner", "a\u0000b nul", "\u001b[31mred\u001b[0m",
        "\u000b vertical tab \u000c form feed \u0085 next line",
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
        "[BOS]Hello[EOS]", "[BOS] spaced [EOS] ", "<|im_start|><|im_end|>", "<<|im_end|>>", "<|im_end|",
        "[BOS[EOS]]", "text<think>reasoning</think>answer", "<think><think> <think>", "a <|im_end|>b <think> c",
        "[EOS][EOS][EOS]", "<|im_start|>system<|im_start|>",
        "plow plowing snowplow plow_ (plow) plow. Plow 犁plow", "use <tool><call> and  <tool>x <tool> <tool><call",
        "x\u180e\u180ey", "  <|im_end|>  \t<think>\n\n<|im_end|>",
        {"repeat": "the", "count": 8334, "suffix": ""},
        {"repeat": " ", "count": 25010, "suffix": "x"},
        {"repeat": "Hello, wörld! 你好 ", "count": 120, "suffix": "<|im_end|>"},
    ]


def expand(entry):
    if isinstance(entry, str):
        return entry
    return entry.get("prefix", "") + entry["repeat"] * entry["count"] + entry["suffix"]


# Inputs too long to store ids for: checked by id count and FNV-1a-64 over the ids as little-endian int32.
# The first crosses tokenization_kimi.py's 400k-character window boundary inside a word.
HASHED_STRINGS = [
    {"prefix": " ", "repeat": "ab", "count": 200_000, "suffix": "中文 end"},
    {"prefix": "", "repeat": "Hello, wörld! 你好 <|im_end|>\n\tdef f(x): return x**2  # ok\r\n", "count": 12_000,
     "suffix": ""},
]


def fnv1a64(ids):
    h = 0xCBF29CE484222325
    for i in ids:
        for byte in int(i).to_bytes(4, "little", signed=True):
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (nlohmann::json::merge_patch applies the same rules in the C++ test)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def variants(base):
    """Patches over hf_merges_pairs that exercise the tokenizer.json features plow implements."""
    vocab_n = max(t["id"] for t in base["added_tokens"]) + 1

    def split(pattern, behavior, invert=False, kind="Regex"):
        return {"type": "Split", "pattern": {kind: pattern}, "behavior": behavior, "invert": invert}

    byte_level_plain = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    added = copy.deepcopy(base["added_tokens"])
    for t in added:
        if t["content"] == "<|im_end|>":
            t["lstrip"], t["rstrip"] = True, True
        if t["content"] == NON_SPECIAL:
            t["rstrip"] = True
    added += [
        {"id": vocab_n, "content": "plow", "single_word": True, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False},
        {"id": vocab_n + 1, "content": "<tool>", "single_word": False, "lstrip": True, "rstrip": False,
         "normalized": False, "special": True},
        {"id": vocab_n + 2, "content": "<tool><call>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
        {"id": vocab_n + 3, "content": "世界", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False},
    ]
    return {
        "gpt2_bytelevel": {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                             "use_regex": True}},
        "bytelevel_prefix_space": {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True,
                                                     "trim_offsets": True, "use_regex": True}},
        "split_prefix_space": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            split(LLAMA3_PAT, "Isolated"),
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": False}]}},
        "kimi_split": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            split(KIMI_PAT, "Isolated"), byte_level_plain]}},
        "split_behaviors": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            split(r"\s+", "MergedWithPrevious"), split(r"\p{N}", "MergedWithNext"),
            split(r"[.,;:!?]", "Contiguous"), split("-", "Removed", kind="String"),
            split(r"\p{Lu}", "Isolated"), byte_level_plain]}},
        "split_invert": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            split(r"\p{L}+|\p{N}+", "Removed", invert=True), split(r"(?i)[aeiou]", "Isolated", invert=True),
            byte_level_plain]}},
        "digits_split_then_gpt2": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            split(r"\p{N}{1,3}", "Isolated"), split(r"[一-龥぀-ゟ゠-ヿ]+", "Isolated"),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}},
        "added_token_flags": {"added_tokens": added},
        "ignore_merges": {"model": {"ignore_merges": True}},
    }


def hf_cases(tok_json, strings, long_strings=True):
    """One case per corpus string; null for the long strings when long_strings is off (keeps the file small)."""
    tok = Tokenizer.from_str(json.dumps(tok_json))
    cases = []
    for s in strings:
        if not long_strings and len(s) > LONG_CHARS:
            cases.append(None)
            continue
        tok.encode_special_tokens = False
        ids = tok.encode(s, add_special_tokens=False).ids
        tok.encode_special_tokens = True
        ids_plain = tok.encode(s, add_special_tokens=False).ids
        case = {"ids": ids}
        if ids_plain != ids:
            case["ids_no_special"] = ids_plain
        decoded = tok.decode(ids, skip_special_tokens=False)
        if decoded != s:
            case["decoded"] = decoded
        skipped = tok.decode(ids, skip_special_tokens=True)
        if skipped != decoded:
            case["decoded_skip_special"] = skipped
        cases.append(case)
    return cases


def hf_decode_cases(tok_json):
    """Id sequences whose bytes are not valid UTF-8: decode must replace them exactly like HF does."""
    tok = Tokenizer.from_str(json.dumps(tok_json))
    byte_char = {b: c for b, c in zip(range(256), bytes_to_unicode_chars())}
    byte_id = {b: tok_json["model"]["vocab"][byte_char[b]] for b in range(256)}
    raw = [b"\xe2\x82", b"\xe2\x82A", b"\xf0\x80", b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
           b"\xe4\xbd", b"\xe4\xbd\xa0", "é".encode() + b"\xa9\xa9", b"\xf0\x9f\x98", b"\xf0\x9f\x98\x80\x80"]
    cases = []
    for r in raw:
        ids = [byte_id[b] for b in r]
        cases.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    special_ids = [tok.token_to_id(s) for s in SPECIALS]
    mixed = [byte_id[0xe4], special_ids[3], byte_id[0xbd], byte_id[0xa0]]
    cases.append({"ids": mixed, "decoded": tok.decode(mixed, skip_special_tokens=False),
                  "decoded_skip_special": tok.decode(mixed, skip_special_tokens=True)})
    return cases


def bytes_to_unicode_chars():
    """GPT-2's byte -> printable character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiktoken_fixture(tok_json):
    """tiktoken.model from the trained vocab (ranks = HF id order without the added tokens) + Kimi's config."""
    char_byte = {c: b for b, c in enumerate(bytes_to_unicode_chars())}
    added_ids = {t["id"] for t in tok_json["added_tokens"]}
    vocab = sorted((i, s) for s, i in tok_json["model"]["vocab"].items() if i not in added_ids)
    ranks = {bytes(char_byte[c] for c in s): rank for rank, (_, s) in enumerate(vocab)}
    base = len(ranks)
    decoder = {}
    for offset, content in enumerate(SPECIALS):
        decoder[str(base + offset)] = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True}
    decoder[str(base + len(SPECIALS))] = {"content": NON_SPECIAL, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": False}
    decoder[str(base + KIMI_RESERVED - 1)] = {"content": "[PAD]", "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False, "special": True}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
              "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576}
    # tokenization_kimi.py: every reserved slot is a special token, named from the config or by its id.
    names = {int(k): v["content"] for k, v in decoder.items()}
    special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + KIMI_RESERVED)}
    enc = tiktoken.Encoding(name="plow-test", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=special_tokens)
    lines = "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))
    skip = {i for i in range(base, base + KIMI_RESERVED) if names.get(i) is None or decoder[str(i)]["special"]}
    return lines, config, enc, skip


def kimi_split_runs(s, max_len):
    """tokenization_kimi.py _split_whitespaces_or_nonwhitespaces, verbatim in behaviour."""
    current_len, current_is_space, start = 0, s[0].isspace() if s else False, 0
    for i in range(len(s)):
        is_space = s[i].isspace()
        if current_is_space ^ is_space:
            current_len, current_is_space = 1, is_space
        else:
            current_len += 1
            if current_len > max_len:
                yield s[start:i]
                start, current_len = i, 1
    yield s[start:]


def kimi_encode(enc, s, allow_special):
    ids = []
    for i in range(0, len(s), 400_000):
        for sub in kimi_split_runs(s[i:i + 400_000], 25_000):
            if allow_special:
                ids.extend(enc.encode(sub, allowed_special="all"))
            else:
                ids.extend(enc.encode(sub, disallowed_special=()))
    return ids


def tiktoken_cases(enc, skip, strings):
    cases = []
    for s in strings:
        ids = kimi_encode(enc, s, True)
        plain = kimi_encode(enc, s, False)
        case = {"ids": ids}
        if plain != ids:
            case["ids_no_special"] = plain
        decoded = enc.decode(ids)  # errors="replace", like HF's decode
        if decoded != s:
            case["decoded"] = decoded
        skipped = enc.decode([i for i in ids if i not in skip])
        if skipped != decoded:
            case["decoded_skip_special"] = skipped
        cases.append(case)
    return cases


def kimi_class_ranges():
    """The code points each set-operation class of KIMI_PAT matches, per the `regex` module (which implements
    `&&` like Rust's regex crate), as [first, last] ranges, over the code points assigned in this Python's
    Unicode version (14.0.0 for 3.11, which is PCRE2 10.42's too). The `regex` module carries newer Unicode
    tables; code points whose general category changed since (e.g. U+0295 Ll -> Lo in 16.0) are listed in
    "unicode_version_skips" and not compared."""
    classes = {
        "upper_not_han": (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", {"Lu", "Lt", "Lm", "Lo", "Mn", "Mc", "Me"}, False),
        "lower_not_han": (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", {"Ll", "Lm", "Lo", "Mn", "Mc", "Me"}, False),
        "han": (r"[\p{Han}]", None, True),
    }
    han = regex.compile(r"\p{Han}")
    assigned = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) != "Cn"]
    out = {}
    for name, (pattern, categories, han_only) in classes.items():
        compiled = regex.compile(pattern, regex.V1)
        ranges, skips = [], []
        for c in assigned:
            ch = chr(c)
            got = bool(compiled.fullmatch(ch))
            if not han_only and got != (unicodedata.category(ch) in categories and not han.fullmatch(ch)):
                skips.append(c)
                continue
            if got:
                if ranges and ranges[-1][1] == c - 1:
                    ranges[-1][1] = c
                else:
                    ranges.append([c, c])
        out[name] = {"pattern": pattern, "ranges": ranges, "unicode_version_skips": skips}
    return out


def write_json(path, obj, indent=None):
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=indent) + "\n", encoding="utf-8")


def main():
    tok_json = train()
    pairs = tok_json
    strings_form = copy.deepcopy(tok_json)
    strings_form["model"]["merges"] = [" ".join(m) for m in tok_json["model"]["merges"]]
    for name, obj in [("hf_merges_pairs", pairs), ("hf_merges_strings", strings_form)]:
        (OUT / name).mkdir(exist_ok=True)
        write_json(OUT / name / "tokenizer.json", obj)
    assert Tokenizer.from_file(str(OUT / "hf_merges_strings" / "tokenizer.json")).get_vocab_size() == \
        Tokenizer.from_file(str(OUT / "hf_merges_pairs" / "tokenizer.json")).get_vocab_size()

    raw_corpus = corpus()
    strings = [expand(e) for e in raw_corpus]
    fixtures = {
        "hf_merges_pairs": {"dir": "hf_merges_pairs", "cases": hf_cases(pairs, strings)},
        "hf_merges_strings": {"dir": "hf_merges_strings", "cases": hf_cases(strings_form, strings, False)},
    }
    for name, patch in variants(pairs).items():
        cases = hf_cases(merge_patch(pairs, patch), strings, name in WITH_LONG_STRINGS)
        fixtures[name] = {"dir": "hf_merges_pairs", "patch": patch, "cases": cases}

    lines, config, enc, skip = tiktoken_fixture(tok_json)
    (OUT / "kimi_tiktoken").mkdir(exist_ok=True)
    (OUT / "kimi_tiktoken" / "tiktoken.model").write_text(lines)
    write_json(OUT / "kimi_tiktoken" / "tokenizer_config.json", config, indent=2)
    fixtures["kimi_tiktoken"] = {"dir": "kimi_tiktoken", "cases": tiktoken_cases(enc, skip, strings)}

    hashed = []
    for entry in HASHED_STRINGS:
        s = expand(entry)
        hf_ids = Tokenizer.from_str(json.dumps(pairs)).encode(s, add_special_tokens=False).ids
        kimi_ids = kimi_encode(enc, s, True)
        hashed.append({"text": entry, "chars": len(s),
                       "hf_merges_pairs": {"count": len(hf_ids), "fnv1a64": fnv1a64(hf_ids)},
                       "kimi_tiktoken": {"count": len(kimi_ids), "fnv1a64": fnv1a64(kimi_ids)}})

    expected = {
        "generator": "tests/data/tokenizers/make_tokenizer_fixtures.py",
        "tokenizers_version": tokenizers.__version__,
        "tiktoken_version": tiktoken.__version__,
        "python_version": sys.version.split()[0],
        "regex_version": regex.__version__,
        "unicode_version": unicodedata.unidata_version,
        "kimi_pattern": KIMI_PAT,
        "kimi_classes": kimi_class_ranges(),
        "strings": raw_corpus,
        "fixtures": fixtures,
        "decode_cases": {"fixture": "hf_merges_pairs", "cases": hf_decode_cases(pairs)},
        "hashed_cases": hashed,
    }
    write_json(OUT / "expected.json", expected)
    sizes = {p.relative_to(OUT).as_posix(): p.stat().st_size for p in sorted(OUT.rglob("*")) if p.is_file()}
    print(json.dumps(sizes, indent=1), "total", sum(sizes.values()))


if __name__ == "__main__":
    main()
