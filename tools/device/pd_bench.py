#!/usr/bin/env python3
"""Prefill / decode disaggregation on one GPU: what the decode server's first token costs with the prompt's KV read
from a prefill server (SGLang's bootstrap rooms, the KV over HTTP) against computing the prompt itself.

Starts a prefill server (--disaggregation-mode prefill) and a decode server (--disaggregation-mode decode) of the
same model (dummy weights, token ids only), 0.4 of the GPU's memory each. For each prompt length: a fresh random
prompt to the prefill server (one token), then to the decode server with the same room (the read + the last page +
one token), and another fresh prompt to the decode server alone (the whole prefill there). Prints one line per
length: the times (median of REPEATS), the KV bytes moved (the decode server's metrics) and whether the first tokens
agree.

usage: pd_bench.py MLASERVE_BINARY MODEL_DIR [LENGTHS (comma-separated, default 1024,4096,16384)] [REPEATS (3)]
(PD_MEM_FRACTION: each server's --mem-fraction-static, default 0.4; 0.47 fits V2-Lite twice on an 80 GB GPU)
"""
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metric(port, name):
    """A counter of the server's /metrics (mlaserve's name), 0 when absent."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith(f"mlaserve:{name} "):
            return float(line.split()[1])
    return 0.0


def wait_up(port, proc, log):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"server on {port} exited: {open(log).read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    sys.exit(f"server on {port} did not start")


def main():
    binary, model = sys.argv[1], sys.argv[2]
    lengths = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1024,4096,16384").split(",")]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    boot, pport, dport = free_port(), free_port(), free_port()
    common = [binary, "serve", "--model-path", model, "--load-format", "dummy", "--skip-tokenizer-init",
              "--host", "127.0.0.1", "--mem-fraction-static", os.environ.get("PD_MEM_FRACTION", "0.4"),
              "--context-length", str(max(lengths) + 64),
              "--log-level", "warning"]
    procs = []
    for port, extra, log in ((pport, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                      str(boot)], "/tmp/pd_prefill.log"),
                             (dport, ["--disaggregation-mode", "decode"], "/tmp/pd_decode.log")):
        procs.append((subprocess.Popen(common + ["--port", str(port)] + extra, stdout=open(log, "w"),
                                       stderr=subprocess.STDOUT), port, log))
    try:
        for p, port, log in procs:
            wait_up(port, p, log)
        info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{pport}/get_server_info").read())
        cfg = json.load(open(f"{model}/config.json"))
        rng = random.Random(7)
        vocab = cfg["vocab_size"]
        room = 1
        for n in lengths:
            t_pre, t_dec, t_alone, same, moved = [], [], [], [], []
            for _ in range(repeats):
                ids = [rng.randrange(100, vocab - 100) for _ in range(n)]
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}
                room += 1
                t0 = time.perf_counter()
                pre = post(pport, "/generate", body)
                before = metric(dport, "kv_transfer_received_bytes_total")
                t1 = time.perf_counter()
                dec = post(dport, "/generate", body)
                t2 = time.perf_counter()
                moved.append(metric(dport, "kv_transfer_received_bytes_total") - before)
                alone = {"input_ids": [rng.randrange(100, vocab - 100) for _ in range(n)],
                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
                t3 = time.perf_counter()
                post(dport, "/generate", alone)
                t4 = time.perf_counter()
                t_pre.append(t1 - t0)
                t_dec.append(t2 - t1)
                t_alone.append(t4 - t3)
                same.append(pre["output_ids"] == dec["output_ids"][:1] and
                            dec["meta_info"]["cached_tokens"] >= n - 64)
            print(f"prompt {n}: prefill server {statistics.median(t_pre) * 1e3:.1f} ms, decode server with the KV "
                  f"read {statistics.median(t_dec) * 1e3:.1f} ms ({statistics.median(moved) / 1e6:.1f} MB moved, "
                  f"the decode server's kv_transfer_received_bytes_total), decode server computing "
                  f"it {statistics.median(t_alone) * 1e3:.1f} ms; first tokens equal and rows cached: {same}",
                  flush=True)
        print("server_info disaggregation:", info.get("disaggregation_mode"), info.get("disaggregation_bootstrap_port"))
    finally:
        for p, _, _ in procs:
            p.terminate()
        for p, _, _ in procs:
            p.wait(timeout=60)


if __name__ == "__main__":
    main()
