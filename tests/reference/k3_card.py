"""The model card (README.md) of the bundled model, written by train_k3.py from what the run measured."""

from __future__ import annotations

import json

import torch

import k3_corpus


def _f(x, nd=4):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _e(x):
    return "n/a" if x is None else f"{x:.2e}"


def write(st, path):
    a, sm, c = st.args, st.summary, st.cfg
    tr = sm.get("training") or {}
    ref = sm.get("reference") or {}
    agr = ref.get("agreement") or {}
    fx = sm.get("fixture") or {}
    ppl = fx.get("perplexity") or {}
    device = torch.cuda.get_device_name(0) if st.device.type == "cuda" else "CPU"
    lines = []
    if a.placeholder:
        lines += ["> **PLACEHOLDER.** This is a tiny model trained for about a minute on a CPU to check the",
                  "> pipeline end to end. It is not the bundled model: run the command in",
                  "> `tests/reference/README.md` (section *Bundled model*) on the GPU machine to replace it.", ""]
    lines += [f"# {a.name}", "",
              "A small **Kimi K3-architecture** causal language model trained on Python source code, bundled with",
              "plow as its default model. Every K3 feature is on: Block Attention Residuals, LatentMoE with",
              "MXFP4 routed experts, gated NoPE MLA with q-LoRA, SiTU activations, lower-bounded and full-rank",
              "KDA gates. It was trained and exported by `tests/reference/train_k3.py`; the perplexity and",
              "greedy fixtures in `tests/data/bundled-model/` come from `tests/reference/k3_reference.py` (fp32).",
              "", "It writes Python-looking text; it is far too small to write correct programs.", "",
              "## Data", "",
              "The Python sources (`*.py`) of these installed packages, read from site-packages; vendored",
              f"third-party directories ({', '.join(sorted(k3_corpus.SKIP_DIRS - {'__pycache__'}))}) and files over",
              f"{k3_corpus.MAX_FILE_BYTES // 1000} kB were skipped. Licenses are the distributions' own metadata.", "",
              "| package | version | license | files | MB |", "|---|---|---|---|---|"]
    for p in st.corpus.packages:
        lines.append(f"| {p.distribution} | {p.version} | {p.license} | {p.files} | {p.bytes / 1e6:.1f} |")
    lines += ["", f"Split by file: crc32(path) % 100 < {k3_corpus.HELDOUT_PERCENT} is held out "
              f"({len(st.corpus.heldout)} held-out files, {len(st.corpus.train)} train files). "
              f"{st.n_chats} chat-format examples (a docstring summary as the request, the function as the answer) "
              f"were made from train files. Train stream: {st.train_tokens / 1e6:.2f}M tokens; held-out: "
              f"{st.heldout_tokens / 1e6:.3f}M tokens.", "",
              "## Tokenizer", "",
              f"Byte-level BPE (HF `tokenizers`, GPT-2 pre-tokenizer regex), vocabulary {st.tok.get_vocab_size()}, "
              f"special tokens {', '.join(f'`{s}` = {i}' for i, s in enumerate(k3_corpus.SPECIAL_TOKENS))}. "
              "Documents are separated by `<|endoftext|>`. Chat template (ChatML style, in tokenizer_config.json):", "",
              "```jinja", k3_corpus.CHAT_TEMPLATE, "```", "",
              "## Architecture", "",
              "| field | value |", "|---|---|"]
    rows = [("parameters", f"{st.n_params / 1e6:.2f}M"), ("hidden", c.hidden_size), ("layers", c.num_hidden_layers),
            ("KDA layers (1-based)", c.kda_layers), ("MLA layers (1-based)", c.full_attn_layers),
            ("KDA heads x dim", f"{c.kda_num_heads} x {c.kda_head_dim}, gate lower bound {c.gate_lower_bound}, full-rank output gate"),
            ("MLA", f"{c.num_attention_heads} heads, q_lora {c.q_lora_rank}, kv_lora {c.kv_lora_rank}, "
                    f"nope {c.qk_nope_head_dim} + shared key {c.qk_rope_head_dim}, v {c.v_head_dim}, output gate"),
            ("dense FFN (layer 0)", c.intermediate_size),
            ("MoE", f"{c.num_experts} experts, top-{c.num_experts_per_token}, expert width {c.moe_intermediate_size}, "
                    f"latent {c.routed_expert_hidden_size} (+ norm), {c.num_shared_experts} shared"),
            ("AttnRes block size (layers)", c.attn_res_block_size), ("activation", "SiTU (4, 25)"),
            ("storage", "bf16; A_log, dt_bias, router bias fp32; routed experts MXFP4 (compressed-tensors)")]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "## Training", "",
              f"{tr.get('steps')} steps, {(tr.get('tokens') or 0) / 1e6:.2f}M tokens in {tr.get('seconds')} s on {device} "
              f"(torch {torch.__version__}); batch {tr.get('batch')} x {tr.get('seq_len')} tokens; {tr.get('optimizer')}, "
              f"peak lr {tr.get('peak_lr')}, warmup {tr.get('warmup_steps')} steps, weight decay {tr.get('weight_decay')}; "
              f"{'bf16 autocast' if tr.get('autocast') == 'bf16' else 'fp32 (no autocast)'}; MoE load balance by the selection bias (aux-loss free, rate "
              f"{tr.get('router_bias_rate')}); the last {int(100 * (tr.get('qat_frac') or 0))}% of the time with "
              "fake-MXFP4 experts (straight-through). Held-out loss during training:", "",
              "| step | seconds | train loss | held-out loss |", "|---|---|---|---|"]
    lines += [f"| {h['step']} | {h['seconds']} | {h['train_loss']} | {h['heldout_loss']} |" for h in tr.get("history", [])]
    lines += ["", "## Evaluation (held-out files, mean next-token loss in nats)", "",
              "| weights | training forward, fp32 | k3_reference, fp32 |", "|---|---|---|",
              f"| as trained (fp32) | {_f(sm.get('heldout_loss_trained_fp32'))} | |",
              f"| bf16, experts unquantized | {_f(sm.get('heldout_loss_before_mxfp4'))} | {_f(ref.get('heldout_loss_before_mxfp4'))} |",
              f"| **shipped: bf16, MXFP4 experts** | {_f(sm.get('heldout_loss_after_mxfp4'))} | {_f(ref.get('heldout_loss_after_mxfp4'))} |",
              "", f"Training forward: {sm.get('eval_tokens')} tokens; reference: {ref.get('reference_tokens')} tokens "
              f"(windows of {a.seq_len}); on the reference's windows the training forward gives "
              f"{_f(ref.get('training_forward_loss_same_windows'))}. Training forward vs reference on {agr.get('tokens')} "
              f"held-out tokens: max |logit difference| {_e(agr.get('max_abs_logit_diff'))} (tolerance {agr.get('tolerance_max_abs')}), argmax "
              f"agreement {agr.get('argmax_agreement')}.", "",
              f"`tests/data/bundled-model/heldout-python.txt` ({ppl.get('tokens')} tokens, one sequence): reference "
              f"perplexity **{_f(ppl.get('ppl'), 3)}** (nll {_f(ppl.get('nll'))}).", "",
              "Greedy continuations (reference):", ""]
    for case in fx.get("greedy", []):
        lines += ["```", case["prompt"] + "⟨" + case["full_greedy_text"] + "⟩", "```"]
    lines += ["", "## Reproduce", "", "```sh",
              "python3 tests/reference/train_k3.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                 [("size", a.size), ("train_seconds", a.train_seconds),
                                                                  ("seq_len", a.seq_len), ("batch", a.batch), ("lr", a.lr),
                                                                  ("vocab", a.vocab), ("corpus_mb", a.corpus_mb),
                                                                  ("seed", a.seed)]) + " --work /tmp/k3",
              "```", "", "Training is timed, so another machine gives other weights. Run it with plow:", "", "```sh",
              f"build/bin/plow generate --model models/{a.name} --prompt 'def fibonacci(n):' --max-new-tokens 64",
              f"build/bin/plow eval-ppl --model models/{a.name} --text-file tests/data/bundled-model/heldout-python.txt",
              "```", "", "Run summary: `" + json.dumps({"errors": sm.get("errors")}) + "`", ""]
    path.write_text("\n".join(lines))
