"""The benchmark's HTTP client of vLLM's OpenAI server: streamed completions
(:func:`streamed_request`), some of whose clients walk away, closing the connection at a chosen
phase of the request as a user pressing "stop" does (vLLM then aborts the request):
``bench_vllm_server.py``'s workloads, ``--workloads abort`` among them.

Phases (:data:`PHASES`), each read off what the client itself can see:

* "prefill": after the server has logged two of the request's bounded-prefill compressions
  (``kvprune_cuda: request <id> keeps ...``), i.e. in the middle of its chunked prefill with
  blocks already freed once (a ``prefill_max_held`` server only);
* "first": right after the first generated token (the prompt compressed, nothing decoded);
* "decode": after half the requested tokens (past any decode-time compression due by then).

Every request carries ``X-Request-Id`` so its lines in the server log can be told apart; after
an abort workload :func:`pool_after` reads the scheduler's idle line: every block back in the
pool or not.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.parse

PHASES = ("prefill", "first", "decode")
PREFILL_COMPRESSIONS = 2  # "prefill": the request's bounded compressions seen before the abort
IDLE_POOL = re.compile(r"kvprune_cuda: idle: \d+ blocks freed by compression in all; (\d+) of "
                       r"(\d+) blocks free in the pool")


def compressions(log_text: str, req_id: str, before: int = None) -> int:
    """How many kvprune compression lines the server log has for the request whose
    ``X-Request-Id`` was ``req_id`` (vLLM's own id: ``cmpl-<req_id>-<index>-<suffix>``);
    with ``before``, only those made before that many tokens were computed (a bounded
    prefill's chunks, not the whole prompt's compression)."""
    totals = re.findall(rf"kvprune_cuda: request cmpl-{re.escape(req_id)}-\S+ keeps \d+ of "
                        r"(\d+) tokens", log_text)
    return sum(before is None or int(t) < before for t in totals)


def streamed_request(server, ids: list, gen: int, req_id: str, t0: float, record: dict,
                     phase=None, log_from: int = 0) -> None:
    """One streamed ``/v1/completions`` of prompt ``ids`` (greedy, ``gen`` tokens, EOS
    ignored) under ``X-Request-Id: req_id``; with ``phase`` (:data:`PHASES`) the client closes
    the connection there. ``record`` gets arrival, first and last token times (s after
    ``t0``), the text, the tokens received, and for an abort the phase and the request's
    compressions in the log (past ``log_from``) when the client left. An HTTP error raises."""
    url = urllib.parse.urlsplit(server.url("/v1/completions"))
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
    body = {"model": "m", "prompt": ids, "max_tokens": gen, "temperature": 0,
            "ignore_eos": True, "stream": True}
    record.update(arrival=time.perf_counter() - t0, first=None, last=None, tokens=0)
    conn.request("POST", url.path, json.dumps(body),
                 {"Content-Type": "application/json", "X-Request-Id": req_id})
    sock = conn.sock  # the response may own it alone (Connection: close)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{req_id}: HTTP {resp.status}: {resp.read()[:500]!r}")
    lock, done = threading.Lock(), threading.Event()

    def leave(why) -> bool:
        """Closes the connection once (the reader below sees it end) unless the request is
        over or ``why()`` no longer holds; then notes the phase and the log's compressions."""
        with lock:
            if done.is_set() or not why():
                return False
            done.set()
            record.update(aborted=phase, abort_at=time.perf_counter() - t0)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        record["compressions_at_abort"] = compressions(server.text()[log_from:], req_id)
        return True

    def watch():  # "prefill": leave after the prompt's first bounded compressions
        while not done.is_set():
            if compressions(server.text()[log_from:], req_id, len(ids)) >= PREFILL_COMPRESSIONS \
                    and leave(lambda: record["first"] is None):
                return
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True) if phase == "prefill" else None
    if watcher:
        watcher.start()
    text = []
    try:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter() - t0
                with lock:
                    if done.is_set():
                        break
                    record["first"] = now if record["first"] is None else record["first"]
                    record["last"] = now
                    record["tokens"] += 1
                text.append(event["choices"][0]["text"])
                if (phase == "first" or phase == "decode" and record["tokens"] >= gen // 2) \
                        and leave(lambda: True):
                    break
    except (OSError, http.client.HTTPException):
        if "aborted" not in record:
            raise
    finally:
        with lock:
            done.set()
        if watcher:
            watcher.join()
        resp.close()
        conn.close()
    record["text"] = "".join(text)


def pool_after(server, log_from: int, timeout: float = 600) -> dict:
    """Waits for the scheduler's idle line past ``log_from`` in the server log (the last
    request gone); its free blocks and the pool's usable blocks."""
    end = time.time() + timeout
    while time.time() < end:
        found = IDLE_POOL.findall(server.text()[log_from:])
        if found:
            free, total = map(int, found[-1])
            return {"free_blocks": free, "usable_blocks": total, "whole": free == total}
        time.sleep(1)
    raise TimeoutError(f"no kvprune idle line in the server log within {timeout} s")


def abort_workload(server, reqs: list, gen: int, phases: list, tag: str) -> dict:
    """A burst of ``reqs`` ([(ids, pass key)]) where request i's client leaves at
    ``phases[i]`` (None, or past the list: it stays to the end); then the pool after the
    last request. Per request: its phase, tokens received, compressions in the log when its
    client left; for those that stayed, pass keys right."""
    log_from = len(server.text())
    t0 = time.perf_counter()
    records = [dict() for _ in reqs]
    threads = [threading.Thread(target=streamed_request, args=(
        server, ids, gen, f"{tag}{i}", t0, rec, phases[i] if i < len(phases) else None,
        log_from)) for i, ((ids, _), rec) in enumerate(zip(reqs, records))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pool = pool_after(server, log_from)
    stayed = [(key, r) for (_, key), r in zip(reqs, records) if not r.get("aborted")]
    hit = [key in r["text"][:40] for key, r in stayed]
    log = server.text()[log_from:]
    aborts = [{**{k: r.get(k) for k in ("aborted", "tokens", "compressions_at_abort", "abort_at")},
               "compressions_after_abort": compressions(log, f"{tag}{i}")
               - r["compressions_at_abort"]}  # > 0: the server went on with it
              for i, r in enumerate(records) if r.get("aborted")]
    return {"makespan_s": time.perf_counter() - t0, "pool": pool, "n": len(reqs),
            "aborts": aborts, "stayed": len(stayed), "hits": sum(hit), "hit": hit,
            "compressions": {f"{tag}{i}": compressions(log, f"{tag}{i}")
                             for i in range(len(reqs))}}
