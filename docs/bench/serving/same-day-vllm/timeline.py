"""C clients against a running server (the serving bench's prompts, order and messages): per-request
timestamps and the CPU time of the server's processes, sampled every 0.25 s.
usage: timeline.py URL C N OUT.json PIDS (the HTTP process first, then the engines; comma-separated)"""
import json, sys, threading, time, os, random
from concurrent.futures import ThreadPoolExecutor
from speculum.bench.serving import _messages
from speculum.bench.data import load_prompts
import openai
url, C, N, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pids = [int(p) for p in sys.argv[5].split(",")]
prompts = list(load_prompts("../shared/data/spec_bench/question_dev.jsonl"))
random.Random(0).shuffle(prompts)
client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
def one(i):
    p = prompts[(1 + i) % len(prompts)]
    t0 = time.time(); first = None; n = 0; chunks = 0; pt = None
    s = client.chat.completions.create(model="default", messages=_messages(p, i), temperature=0, max_tokens=64,
                                       stream=True, stream_options={"include_usage": True})
    for c in s:
        chunks += 1
        if c.choices and c.choices[0].delta.content and first is None: first = time.time()
        if c.usage: n, pt = c.usage.completion_tokens, c.usage.prompt_tokens
    return {"i": i, "t0": t0, "first": first, "end": time.time(), "tokens": n, "prompt": pt, "chunks": chunks}
one(-1)
samples = []; stop = [False]
def sampler():
    while not stop[0]:
        row = [time.time()]
        for p in pids + [os.getpid()]:
            try:
                f = open(f"/proc/{p}/stat").read().split(); row.append(int(f[13]) + int(f[14]))
            except OSError: row.append(None)
        samples.append(row); time.sleep(0.25)
th = threading.Thread(target=sampler); th.start()
lock = threading.Lock(); nxt = [0]; res = []
def worker():
    while True:
        with lock:
            i = nxt[0]
            if i >= N: return
            nxt[0] += 1
        r = one(i)
        with lock: res.append(r)
t0 = time.time()
with ThreadPoolExecutor(C) as ex:
    for f in [ex.submit(worker) for _ in range(C)]: f.result()
wall = time.time() - t0
stop[0] = True; th.join()
json.dump({"wall": wall, "t0": t0, "res": res, "samples": samples, "pids": pids}, open(out, "w"))
tok = sum(r["tokens"] for r in res)
print(f"wall {wall:.1f}s tokens {tok} tok/s {tok/wall:.1f}")
