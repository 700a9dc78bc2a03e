"""The official `openai` Python client against a live `plow serve` (label `server`).

Starts `plow serve` on a free port over a tiny fixture with a tokenizer and chat template, then checks
chat and completions (whole and streamed, which must agree), usage with cached_tokens, stop strings,
logprobs, error objects for bad input (the server keeps serving), prefix-cache hits across turns and in
/metrics, 64 concurrent streaming clients followed by the slot/page integrity check, disconnects that
free their slot, and SIGTERM draining an in-flight stream before exit 0.

usage: openai_client_test.py --plow build/bin/plow --model tests/data/tiny-kimi-linear-chat
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest
import warnings

import openai

ARGS = None
HANG_GUARD_S = 120  # a request that takes longer is a hang, not a slow machine (tiny model, few tokens)


def start_server(*extra):
    proc = subprocess.Popen([ARGS.plow, "serve", "--model", ARGS.model, "--port", "0", *extra],
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "listening on http://" in line:
            port = int(line.strip().rsplit(":", 1)[1])
            break
    else:
        raise RuntimeError(f"plow serve exited with {proc.wait()} before listening")
    # Keep draining stderr so the server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, port


def http_get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_S)
    try:
        conn.request("GET", path)
        res = conn.getresponse()
        return res.status, res.read().decode()
    finally:
        conn.close()


def metrics(port, *names):
    """The values of `names` from one scrape of /metrics (one snapshot: gauges read together agree)."""
    _, text = http_get(port, "/metrics")
    values = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    missing = [name for name in names if name not in values]
    if missing:
        raise AssertionError(f"{', '.join(missing)} missing from /metrics")
    return [values[name] for name in names]


def metric(port, name):
    return metrics(port, name)[0]


def wait_idle(port):
    """Waits (bounded) until no request holds a slot or waits for one; returns the final count of both
    for the caller to assert. Running alone is not enough: a request submitted a moment ago may still
    be queued (running 0, waiting 1) and take its slot right after; both come from one scrape, so a
    request moving from the queue to a slot between two reads is not missed."""
    def busy():
        return sum(metrics(port, "plow:num_requests_running", "plow:num_requests_waiting"))
    deadline = time.monotonic() + 30
    while busy() != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return busy()


class OpenAIClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.proc, cls.port = start_server("--debug-endpoints")
        cls.client = openai.OpenAI(base_url=f"http://127.0.0.1:{cls.port}/v1", api_key="unused", max_retries=0,
                                   timeout=HANG_GUARD_S)
        cls.model = cls.client.models.list().data[0].id

    @classmethod
    def tearDownClass(cls):
        cls.proc.send_signal(signal.SIGTERM)
        assert cls.proc.wait(timeout=HANG_GUARD_S) == 0

    def complete(self, **kw):
        return self.client.completions.create(model=self.model, temperature=0, extra_body={"ignore_eos": True}, **kw)

    def chat(self, messages, **kw):
        return self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                                   extra_body={"ignore_eos": True}, **kw)

    def test_models(self):
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], ["tiny-kimi-linear-chat"])

    def test_completion_whole_and_streamed_agree(self):
        prompt = "Hello plow, "
        whole = self.complete(prompt=prompt, max_tokens=8)
        self.assertEqual(whole.object, "text_completion")
        self.assertEqual(whole.choices[0].finish_reason, "length")
        self.assertEqual(whole.usage.prompt_tokens, len(prompt.encode()))  # byte-level tokenizer
        self.assertEqual(whole.usage.completion_tokens, 8)
        self.assertEqual(whole.usage.total_tokens, whole.usage.prompt_tokens + 8)
        self.assertIsInstance(whole.usage.prompt_tokens_details.cached_tokens, int)
        chunks = list(self.complete(prompt=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].text)
        self.assertEqual([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason], ["length"])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, 8)
        self.assertEqual(chunks[-1].usage.prompt_tokens, whole.usage.prompt_tokens)
        self.assertIsNotNone(chunks[-1].usage.prompt_tokens_details)

    def test_chat_whole_and_streamed_agree(self):
        messages = [{"role": "user", "content": "Say something."}]
        whole = self.chat(messages, max_tokens=6)
        self.assertEqual(whole.object, "chat.completion")
        self.assertEqual(whole.choices[0].message.role, "assistant")
        self.assertEqual(whole.choices[0].finish_reason, "length")
        self.assertEqual(whole.usage.completion_tokens, 6)
        self.assertEqual(whole.usage.prompt_tokens, len("<user>Say something.\n<assistant>".encode()))
        chunks = list(self.chat(messages, max_tokens=6, stream=True, stream_options={"include_usage": True}))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].message.content)
        self.assertEqual(chunks[-1].usage.completion_tokens, 6)

    def test_stop_string_cuts_the_text(self):
        text = self.complete(prompt="abc", max_tokens=12).choices[0].text
        self.assertGreater(len(text), 3)
        stop = text[2:4]
        cut = self.complete(prompt="abc", max_tokens=12, stop=[stop])
        self.assertEqual(cut.choices[0].finish_reason, "stop")
        self.assertEqual(cut.choices[0].text, text[:text.find(stop)])
        streamed = "".join(c.choices[0].text for c in self.complete(prompt="abc", max_tokens=12, stop=[stop], stream=True))
        self.assertEqual(streamed, cut.choices[0].text)

    def test_logprobs(self):
        r = self.complete(prompt="xyz", max_tokens=4, logprobs=2)
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), 4)
        self.assertEqual(len(lp.token_logprobs), 4)
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            self.assertLessEqual(chosen, 0.0)
            self.assertEqual(len(top), 2)
            self.assertAlmostEqual(chosen, max(top.values()), places=5)  # greedy picks the most likely
        c = self.chat([{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=2)
        content = c.choices[0].logprobs.content
        self.assertEqual(len(content), 3)
        for entry in content:
            self.assertEqual(len(entry.top_logprobs), 2)
            self.assertAlmostEqual(entry.logprob, entry.top_logprobs[0].logprob, places=5)

    def test_errors_name_the_field_and_the_server_keeps_serving(self):
        with self.assertRaises(openai.NotFoundError) as e:
            self.client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        self.assertIn("gpt-4", e.exception.body["message"])
        cases = [
            (dict(prompt="x", max_tokens=-1), "max_tokens"),
            (dict(prompt="x", max_tokens=10**12), "max_tokens"),
            (dict(prompt="x", max_tokens=1, temperature=-1), "temperature"),
            (dict(prompt="x", max_tokens=1, extra_body={"temperature": "hot"}), "temperature"),
            (dict(prompt="x", max_tokens=1, logprobs=99), "logprobs"),
        ]
        for kw, field in cases:
            with self.assertRaises(openai.BadRequestError, msg=str(kw)) as e:
                self.client.completions.create(model=self.model, **kw)
            self.assertEqual(e.exception.status_code, 400)
            self.assertIn(field, e.exception.body["message"] + str(e.exception.body.get("param")))
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.chat.completions.create(model=self.model, messages="hi")
        self.assertEqual(e.exception.body["param"], "messages")
        # Raw bodies the client cannot send: bad JSON, invalid UTF-8, 12 MB.
        for body, status in [(b'{"prompt": [1, 2', 400), (b'{"prompt": "caf\xff"}', 400), (b" " * (12 << 20), 413)]:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HANG_GUARD_S)
            try:
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                res = conn.getresponse()
                self.assertEqual(res.status, status)
                self.assertIn("message", json.loads(res.read())["error"])
            except (BrokenPipeError, ConnectionResetError):
                # The server may answer 413 and close before the whole 12 MB is sent.
                self.assertEqual(status, 413)
            finally:
                conn.close()
        self.assertEqual(self.complete(prompt="still here", max_tokens=2).usage.completion_tokens, 2)

    def test_prefix_cache_hits_across_turns(self):
        hits_before = metric(self.port, "plow:prefix_cache_hits_total")
        queries_before = metric(self.port, "plow:prefix_cache_queries_total")
        messages = [{"role": "user", "content": "A long system-like opening that every turn repeats. Turn one?"}]
        first = self.chat(messages, max_tokens=5)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Turn two?"}]
        second = self.chat(messages, max_tokens=5)
        # The turn-1 prompt end is a snapshot; the turn end too when the reply re-tokenizes the same.
        self.assertGreaterEqual(second.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens)
        self.assertLess(second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens)
        messages += [{"role": "assistant", "content": second.choices[0].message.content},
                     {"role": "user", "content": "Turn three?"}]
        chunks = list(self.chat(messages, max_tokens=5, stream=True, stream_options={"include_usage": True}))
        self.assertGreaterEqual(chunks[-1].usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens)
        hits = metric(self.port, "plow:prefix_cache_hits_total") - hits_before
        self.assertGreaterEqual(hits, second.usage.prompt_tokens_details.cached_tokens
                                + chunks[-1].usage.prompt_tokens_details.cached_tokens)
        self.assertGreaterEqual(metric(self.port, "plow:prefix_cache_queries_total") - queries_before,
                                first.usage.prompt_tokens + second.usage.prompt_tokens)
        self.assertGreater(metric(self.port, "plow:kv_cache_usage_perc"), 0.0)

    def test_64_concurrent_streams_complete_and_leave_no_leak(self):
        def one(i):
            stream = self.chat([{"role": "user", "content": f"client {i} " * (1 + i % 5)}], max_tokens=8, stream=True)
            text, reasons = "", []
            for c in stream:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    if c.choices[0].finish_reason:
                        reasons.append(c.choices[0].finish_reason)
            return reasons
        with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
            futures = [pool.submit(one, i) for i in range(64)]
            results = [f.result(timeout=HANG_GUARD_S) for f in futures]
        self.assertEqual(results, [["length"]] * 64)
        self.assertEqual(wait_idle(self.port), 0)
        status, body = http_get(self.port, "/debug/integrity")
        self.assertEqual(status, 200, body)
        self.assertTrue(json.loads(body)["ok"])

    def test_disconnect_frees_the_slot(self):
        for stream in (True, False):
            generated_before = metric(self.port, "plow:generation_tokens_total")
            body = json.dumps({"model": self.model, "prompt": "bye", "max_tokens": 4000, "temperature": 0,
                               "ignore_eos": True, "stream": stream}).encode()
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=HANG_GUARD_S)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            self.assertTrue(sock.recv(64).startswith(b"HTTP/1.1 200"))  # the request is running
            sock.close()
            self.assertEqual(wait_idle(self.port), 0, f"stream={stream}")
            self.assertLess(metric(self.port, "plow:generation_tokens_total") - generated_before, 4000,
                            f"stream={stream}: the request ran to the end after its client left")
        status, body = http_get(self.port, "/debug/integrity")
        self.assertEqual(status, 200, body)


class DrainTest(unittest.TestCase):
    def test_sigterm_finishes_the_in_flight_stream_then_exits_0(self):
        proc, port = start_server()
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=HANG_GUARD_S)
            stream = client.completions.create(model="tiny-kimi-linear-chat", prompt="drain", max_tokens=48,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            chunks += list(stream)
            tokens = sum(len(c.choices[0].model_extra.get("token_ids", [])) for c in chunks if c.choices)
            self.assertEqual(tokens, 48)
            self.assertEqual(chunks[-1].choices[0].finish_reason, "length")
            self.assertEqual(proc.wait(timeout=HANG_GUARD_S), 0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--plow", required=True)
    parser.add_argument("--model", required=True)
    ARGS, rest = parser.parse_known_args()
    warnings.simplefilter("ignore", ResourceWarning)  # the openai client's pooled sockets, closed at exit
    unittest.main(argv=[sys.argv[0], "-v", *rest])
