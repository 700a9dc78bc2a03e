#!/usr/bin/env python3
"""Regenerates expected.json: what Python jinja2 renders for every template x conversation in this
folder and for every case in constructs.json, with the environment HF transformers' apply_chat_template
uses (transformers/utils/chat_template_utils.py): ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True, extensions=[generation tag, loopcontrols]), tojson = json.dumps(ensure_ascii=False,
indent, separators, sort_keys), raise_exception, strftime_now (fixed here to FIXED_NOW), dict and
namespace. Runs with system python3 (Jinja2 3.1.6) or /work/pyenv/bin/python; when transformers is
importable it also renders every case through transformers' own compiled environment and fails on any
difference, so the replica below is checked against the real thing.

    python3 tests/data/chat_templates/make_expected.py
"""
import datetime
import json
import pathlib
import sys

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = pathlib.Path(__file__).resolve().parent
FIXED_NOW = datetime.datetime(2025, 3, 14, 9, 26, 53)

# Template file -> the special tokens its tokenizer_config.json declares (None entries are left out,
# as HF's special_tokens_map leaves them out).
TEMPLATES = {
    "kimi_k2": {"bos_token": "[BOS]", "eos_token": "[EOS]"},
    "kimi_k2_thinking": {"bos_token": "[BOS]", "eos_token": "[EOS]"},
    "kimi_k2_thinking_queue": {"bos_token": "[BOS]", "eos_token": "[EOS]"},
    "kimi_k3": {"bos_token": "[BOS]", "eos_token": "[EOS]"},
    "qwen2_5": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3_2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama3_3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "deepseek_v3_1": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "mistral_nemo": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "hermes3_tool_use": {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
    "gpt_oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
}


def make_environment():
    class GenerationTag(Extension):
        # HF's AssistantTracker without tracking: {% generation %}body{% endgeneration %} renders body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return FIXED_NOW.strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def render(compile_fn, source, context):
    try:
        return {"output": compile_fn(source).render(**context)}
    except Exception as e:  # the expected outcome is the error itself
        return {"error": str(e), "error_type": type(e).__name__}


def hf_compile():
    """transformers' own compiled template, with strftime_now pinned; None without transformers."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None

    def compile_fn(source):
        template = _compile_jinja_template(source)
        template.environment.globals["strftime_now"] = lambda format: FIXED_NOW.strftime(format)
        return template

    return compile_fn


def conversation_context(conversation, tool_sets, special_tokens):
    # What apply_chat_template passes: messages, tools (None without tools), documents=None,
    # add_generation_prompt, then the special tokens and template kwargs.
    tools = conversation.get("tools")
    context = {
        "messages": conversation["messages"],
        "tools": tool_sets[tools] if tools else None,
        "documents": None,
        "add_generation_prompt": conversation["add_generation_prompt"],
    }
    context.update(special_tokens)
    context.update(conversation.get("kwargs", {}))
    return context


def construct_context(case):
    # Constructs get apply_chat_template's fixed variables too, so the C++ side can render them as is.
    context = {"tools": None, "documents": None, "add_generation_prompt": False}
    context.update(case["context"])
    return context


def main():
    env = make_environment()
    replica = env.from_string
    hf = hf_compile()
    conversations = json.loads((HERE / "conversations.json").read_text(encoding="utf-8"))
    constructs = json.loads((HERE / "constructs.json").read_text(encoding="utf-8"))

    out = {"_comment": "Generated by make_expected.py; do not edit.", "jinja2": jinja2.__version__,
           "now": FIXED_NOW.isoformat(), "templates": {}, "renders": [], "constructs": []}
    checks = []
    for name, special_tokens in TEMPLATES.items():
        source = (HERE / f"{name}.jinja").read_text(encoding="utf-8")
        out["templates"][name] = {"file": f"{name}.jinja", "special_tokens": special_tokens}
        for conversation in conversations["conversations"]:
            context = conversation_context(conversation, conversations["tool_sets"], special_tokens)
            result = render(replica, source, context)
            out["renders"].append({"template": name, "conversation": conversation["name"], **result})
            checks.append((f"{name} x {conversation['name']}", source, context, result))
    for case in constructs["cases"]:
        context = construct_context(case)
        result = render(replica, case["template"], context)
        out["constructs"].append({"name": case["name"], **result})
        checks.append((case["name"], case["template"], context, result))

    if hf is not None:
        for label, source, context, result in checks:
            theirs = render(hf, source, context)
            if theirs != result:
                sys.exit(f"replica differs from transformers on {label}:\n  replica: {result}\n  hf:      {theirs}")
        print(f"checked {len(checks)} renders against transformers' environment")

    path = HERE / "expected.json"
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    rendered = sum(1 for r in out["renders"] if "output" in r)
    print(f"wrote {path}: {len(out['renders'])} template renders ({rendered} render, "
          f"{len(out['renders']) - rendered} raise), {len(out['constructs'])} constructs")


if __name__ == "__main__":
    main()
