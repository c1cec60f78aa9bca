"""bench_vllm's concurrency statistics on hand-made timelines (no vLLM needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_vllm as bv  # noqa: E402

# (time after the step, running, waiting, KV usage) per step, as run_setting records them
TIMELINE = [(1.0, 2, 3, 0.5), (3.0, 2, 1, 0.9), (4.0, 3, 0, 0.9), (8.0, 1, 0, 0.2)]


def test_mean_running_weights_each_step_by_its_duration_and_starting_count():
    # steps: (0, 1] from 0 running, (1, 3] from 2, (3, 4] from 2, (4, 8] from 3
    assert bv.mean_running(TIMELINE) == pytest.approx((0 + 2 * 2 + 2 * 1 + 3 * 4) / 8)


def test_mean_running_queued_counts_only_steps_that_left_requests_waiting():
    # (0, 1] ended with 2 running, 3 waiting; (1, 3] with 2 running, 1 waiting; then none wait
    assert bv.mean_running_queued(TIMELINE) == pytest.approx((2 * 1 + 2 * 2) / 3)
    assert bv.mean_running_queued([(1.0, 4, 0, 0.1), (2.0, 4, 0, 0.1)]) is None


def test_the_table_reads_runs_saved_before_the_queued_column():
    run = {"setting": "dense", "pool_blocks": 10, "freed_blocks": None, "preemptions": 0,
           "peak_running": 3, "mean_running": 1.75, "gen_tok_per_s": 1.0, "ttft_p50_s": 1.0,
           "ttft_p99_s": 2.0, "tpot_p50_s": 0.1, "tpot_p99_s": 0.2, "makespan_s": 8.0,
           "hits": 4, "n": 4, "timeline": TIMELINE}
    meta = {"machine": "m", "vllm": "0.32.0", "dtype": "float32", "commit": "c", "n": 4,
            "prompt_tokens": 10, "gen": 4, "pool_requests": 1}
    row = bv.table([run], meta).splitlines()[-1]
    assert row.startswith("| dense | 3 | 1.8 | 2.0 | 1.00 | 1.00 |")


def test_the_server_benchmark_reads_kvprune_s_own_timing_from_the_log():
    """compression_cost on a hand-made server log: two compressing steps (2 of 100 ms, 30 of
    300 ms) and two busy periods (0.05 of 2.0 s, 0.15 of 4.0 s), numbers by hand."""
    import bench_vllm_server as bs
    log = "\n".join([
        "(EngineCore pid=1) INFO 12-07 16:25:45 [scheduler.py:213] kvprune_cuda: request a-1 "
        "keeps 82 of 512 tokens, 13 blocks freed (13 in all)",
        "(EngineCore pid=1) INFO 12-07 16:25:45 [scheduler.py:190] kvprune_cuda: step 7 "
        "compressed 1 request(s): kvprune 2.0 ms of the step's 100.0 ms forward (2.00 %)",
        "(EngineCore pid=1) INFO 12-07 16:25:46 [scheduler.py:230] kvprune_cuda: idle: 13 blocks "
        "freed by compression in all; 10 of 10 blocks free in the pool; kvprune's own work "
        "took 0.050 s of 2.000 s of forwards since the last idle (2.50 %)",
        "(EngineCore pid=1) INFO 12-07 16:25:50 [scheduler.py:190] kvprune_cuda: step 9 "
        "compressed 2 request(s): kvprune 30.0 ms of the step's 300.0 ms forward (10.00 %)",
        "(EngineCore pid=1) INFO 12-07 16:25:52 [scheduler.py:230] kvprune_cuda: idle: 20 blocks "
        "freed by compression in all; 10 of 10 blocks free in the pool; kvprune's own work "
        "took 0.150 s of 4.000 s of forwards since the last idle (3.75 %)"])
    cost = bs.compression_cost(log)
    assert cost["compressing_steps"] == 2
    assert cost["compressing_steps_share_pct"] == pytest.approx(100 * 32 / 400)
    assert cost["busy_kvprune_s"] == pytest.approx(0.2)
    assert cost["busy_share_pct"] == pytest.approx(100 * 0.2 / 6.0)
    assert cost["step_share_p50_pct"] == pytest.approx(bv.percentile([2.0, 10.0], 50))
    assert bs.block_trace(log) == {"a-1": [[0.0, 16, 3, 82, 512]]}


def test_the_abort_workload_reads_each_request_s_compressions_and_the_pool_from_the_log():
    """server_client on a hand-made log: request "x-1" compressed twice (once mid-prefill,
    after 2048 tokens, once at its prompt's end, 4600), "x-10" once (its id begins like
    x-1's); the last idle line says whether every block came back."""
    import server_client as sa

    line = ("(EngineCore pid=1) INFO 12-07 21:56:30 [scheduler.py:230] kvprune_cuda: request "
            "cmpl-{}-0-9244408b keeps 1472 of {} tokens, 18 blocks freed (31 in all)")
    idle = ("(EngineCore pid=1) INFO 12-07 21:58:00 [scheduler.py:242] kvprune_cuda: idle: 40 "
            "blocks freed by compression in all; {} of 290 blocks free in the pool; kvprune's "
            "own work took 0.1 s of 9.0 s of forwards since the last idle (1.11 %)")
    log = "\n".join([line.format("x-1", 2048), line.format("x-10", 2048),
                     line.format("x-1", 4600)])
    assert (sa.compressions(log, "x-1"), sa.compressions(log, "x-10"),
            sa.compressions(log, "x-2")) == (2, 1, 0)
    assert (sa.compressions(log, "x-1", 4600), sa.compressions(log, "x-1", 2048)) == (1, 0)

    class Server:
        text = staticmethod(lambda: log + "\n" + idle.format(290) + "\n" + idle.format(287))
    assert sa.pool_after(Server, 0, timeout=1) == {"free_blocks": 287, "usable_blocks": 290,
                                                   "whole": False}
    assert sa.pool_after(Server, len(log) + len(idle.format(290)) - 10, timeout=1)["whole"] \
        is False
    Server.text = staticmethod(lambda: log + "\n" + idle.format(290))
    assert sa.pool_after(Server, 0, timeout=1)["whole"] is True
    Server.text = staticmethod(lambda: log)
    with pytest.raises(TimeoutError, match="no kvprune idle line"):
        sa.pool_after(Server, 0, timeout=0.1)


def test_the_client_streams_a_completion_and_walks_away_at_its_phase():
    """server_client.streamed_request against a local server streaming 6 tokens, 50 ms apart:
    staying, the client gets all 6 in order; leaving at "first" or "decode" (half of 6), the
    server's next writes fail: it saw the connection close (as vLLM does, and aborts)."""
    import http.server
    import json
    import threading
    import time

    import server_client as sa

    seen = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            rid = self.headers["X-Request-Id"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            sent = 0
            try:
                for i in range(6):
                    event = {"choices": [{"text": f"t{i} "}]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                    sent += 1
                    time.sleep(0.05)
                self.wfile.write(b"data: [DONE]\n\n")
                seen[rid] = ("done", sent)
            except OSError:
                seen[rid] = ("closed", sent)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    class Server:
        url = staticmethod(lambda route: f"http://127.0.0.1:{httpd.server_port}{route}")
        text = staticmethod(lambda: "")
    try:
        records = {phase: {} for phase in (None, "first", "decode")}
        for phase, rec in records.items():
            sa.streamed_request(Server, [1, 2], 6, f"r-{phase}", time.perf_counter(), rec, phase)
        for _ in range(100):  # the handlers notice the closed connections on their next writes
            if len(seen) == 3:
                break
            time.sleep(0.05)
    finally:
        httpd.shutdown()
    assert records[None]["text"] == "t0 t1 t2 t3 t4 t5 " and records[None]["tokens"] == 6
    assert "aborted" not in records[None] and seen["r-None"] == ("done", 6)
    assert (records["first"]["tokens"], records["first"]["aborted"]) == (1, "first")
    assert (records["decode"]["tokens"], records["decode"]["aborted"]) == (3, "decode")
    assert seen["r-first"][0] == seen["r-decode"][0] == "closed"
    assert records["first"]["first"] <= records["first"]["abort_at"]
