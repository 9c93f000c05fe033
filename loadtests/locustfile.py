"""Locust user for OpenAI-compatible streaming servers, driven by a seeded poot workload.

Run through `poot-load` (which builds the command line), or by hand:

    locust -f loadtests/locustfile.py --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000 \
        --poot-config '{"scenario": "poisson", "rate": 4, "requests": 40}' --poot-out out/

Every request streams; the user records the arrival offset of every chunk carrying text and
writes one JSON line per request to `<poot-out>/requests-<host>-<pid>.jsonl`. It also fires
locust request events, so locust's CSVs carry them next to the HTTP row:
request_type "SSE", names `ttft`, `tpot`, `gap_p99`, `gap_max`, `e2e` (response_time in ms,
response_length = output tokens) and `disconnect` (a client that left on purpose).
The HTTP row (`POST /v1/completions`) times the response headers only, as locust does for
streamed responses.

Arrivals: in open loop every user takes the next spec and sleeps until its scheduled time, so
the users form a pool that bounds requests in flight (size it with -u); a spec that starts
late because the pool was busy records the lag. In closed loop each user sends the next spec
as soon as its previous one ended. The run ends when the workload is used up (or at -t); with
`cycle` (the soak) a closed loop starts the list again and the run ends at -t only.

A server behind a key: set OPENAI_API_KEY (poot-load does, from its --api-key); every
request then carries it as a bearer token.

Distributed: pass `--poot-workers N` to the master; worker i of N takes specs i, i+N, ...
Each worker writes its own JSONL file; when all workers are done the master stops the test.

Transport: locust's HttpUser (requests + urllib3, made cooperative by gevent). httpx is not
used here: its sync client works under gevent's monkey patching but adds nothing, and its
async client needs an asyncio loop that gevent does not drive.
"""

from __future__ import annotations

import json
import os
import socket
import time

import gevent
from locust import HttpUser, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from poot.loadtests.keys import api_key, headers
from poot.loadtests.sse import StreamRecorder
from poot.loadtests.stats import request_metrics
from poot.loadtests.workloads import LoadConfig, build, request_body


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--poot-config", type=str, default="{}", help="poot LoadConfig as JSON")
    parser.add_argument("--poot-out", type=str, default="", help="folder for per-request JSONL")
    parser.add_argument("--poot-workers", type=int, default=1, help="number of locust workers")


# Locust rewrites its CSVs once a second and workers report to the master every 3 s; waiting a
# little before quitting lets the final CSVs include the last requests.
QUIT_DELAY_S = 1.3
QUIT_DELAY_MASTER_S = 4.0


class _Plan:
    """Per-process workload state (greenlets share it; no locks needed between yields)."""

    def __init__(self, environment):
        opts = environment.parsed_options
        self.cfg = LoadConfig.from_dict(json.loads(opts.poot_config))
        runner = environment.runner
        index, count = 0, 1
        if isinstance(runner, WorkerRunner):
            index, count = max(runner.worker_index, 0), max(1, opts.poot_workers)
        self.specs = [s for s in build(self.cfg) if s.id % count == index]
        self.next = 0
        self.in_flight = 0
        self.t0_wall = time.time()
        self.t0_perf = time.perf_counter()
        out = opts.poot_out or "."
        os.makedirs(out, exist_ok=True)
        name = f"requests-{socket.gethostname()}-{os.getpid()}.jsonl"
        self.sink = open(os.path.join(out, name), "a", encoding="utf-8")  # noqa: SIM115
        self.finished = False

    def take(self):
        """The next spec and its sequence number, or None when the workload is used up."""
        if not self.specs or (self.next >= len(self.specs) and not self.cfg.cycle):
            return None
        seq = self.next
        self.next += 1
        return self.specs[seq % len(self.specs)], seq

    def write(self, rec: dict) -> None:
        self.sink.write(json.dumps(rec) + "\n")
        self.sink.flush()


_plan: _Plan | None = None


def plan_for(environment) -> _Plan:
    global _plan
    if _plan is None:
        _plan = _Plan(environment)
    return _plan


@events.init.add_listener
def _on_init(environment, **_):
    if isinstance(environment.runner, MasterRunner):
        done: set[str] = set()

        def on_done(msg, **_kw):
            done.add(msg.node_id)
            expected = environment.parsed_options.poot_workers
            if len(done) >= expected:
                gevent.spawn_later(QUIT_DELAY_MASTER_S, environment.runner.quit)

        environment.runner.register_message("poot_done", on_done)


def _all_done(environment) -> None:
    plan = plan_for(environment)
    if plan.finished:
        return
    plan.finished = True
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        runner.send_message("poot_done", {"requests": len(plan.specs)})
    else:
        gevent.spawn_later(QUIT_DELAY_S, runner.quit)


class LlmUser(HttpUser):
    """Streams one workload spec per task and records every chunk's arrival."""

    def wait_time(self):  # noqa: D401 - locust hook
        return 0

    def on_start(self):
        # poot-load hands the key over in the environment (OPENAI_API_KEY), never on argv.
        self.client.headers.update(headers(api_key()))

    @task
    def one_request(self):
        plan = plan_for(self.environment)
        taken = plan.take()
        if taken is None:
            if plan.in_flight == 0:
                _all_done(self.environment)
            raise StopUser()
        spec, seq = taken
        # Counted from the moment it is taken: a user sleeping until its arrival time holds it.
        plan.in_flight += 1
        try:
            scheduled = None
            if spec.arrival is not None:
                scheduled = plan.t0_wall + spec.arrival
                delay = plan.t0_perf + spec.arrival - time.perf_counter()
                if delay > 0:
                    gevent.sleep(delay)
            rec = self.stream(plan.cfg, spec)
            rec["t_scheduled"] = scheduled
            rec["seq"] = seq
            plan.write(rec)
            self.fire(rec)
        finally:
            plan.in_flight -= 1
        if plan.next >= len(plan.specs) and plan.in_flight == 0 and not plan.cfg.cycle:
            _all_done(self.environment)

    def stream(self, cfg: LoadConfig, spec) -> dict:
        path, body = request_body(spec, cfg)
        t_wall = time.time()
        rec_ = StreamRecorder(t_sent=time.perf_counter())
        deadline = rec_.t_sent + cfg.timeout_s
        status, err, http_status = "ok", None, None
        try:
            with self.client.post(path, json=body, stream=True, catch_response=True, name=path,
                                  timeout=(10, cfg.timeout_s)) as resp:
                http_status = resp.status_code
                if resp.status_code != 200:
                    status, err = "error", f"HTTP {resp.status_code}: {resp.text[:200]}"
                elif spec.disconnect_after == 0:
                    status = "disconnected"
                else:
                    for data in resp.iter_content(chunk_size=None):
                        rec_.feed(data)
                        if spec.disconnect_after is not None and len(rec_.chunks) >= spec.disconnect_after:
                            status = "disconnected"
                            break
                        if time.perf_counter() > deadline:
                            status, err = "error", f"timeout after {cfg.timeout_s}s"
                            break
                rec_.finish()
                if status == "ok":
                    if rec_.error:
                        status, err = "error", rec_.error
                    elif not rec_.done and rec_.finish_reason is None:
                        status, err = "error", "stream ended without a finish_reason or [DONE]"
                if status == "error":
                    resp.failure(err)
                else:
                    resp.success()
                resp.close()  # on a disconnect this drops the connection mid-stream
        except Exception as exc:  # connection refused, reset, read timeout ...
            status, err = "error", f"{type(exc).__name__}: {exc}"[:200]
            if rec_.end is None:
                rec_.finish()
        rec = rec_.record()
        rec.update(id=spec.id, kind=spec.kind, status=status, error=err, http_status=http_status,
                   t_sent=t_wall, max_tokens=spec.max_tokens, prompt_tokens_target=spec.prompt_tokens_target,
                   disconnect_after=spec.disconnect_after, worker=os.getpid())
        return rec

    def fire(self, rec: dict) -> None:
        fire = self.environment.events.request.fire
        if rec["status"] == "disconnected":
            fire(request_type="SSE", name="disconnect", response_time=(rec["end"] or 0) * 1e3,
                 response_length=len(rec["chunks"]), exception=None, context={})
            return
        m = request_metrics(rec)
        n = m["output_tokens"] or 0
        if rec["status"] == "error":
            fire(request_type="SSE", name="e2e", response_time=(rec["end"] or 0) * 1e3, response_length=n,
                 exception=RuntimeError(rec["error"]), context={})
            return
        for name in ("ttft", "tpot", "gap_p99", "gap_max", "e2e"):
            if m[name] is not None:
                fire(request_type="SSE", name=name, response_time=m[name] * 1e3, response_length=n,
                     exception=None, context={})
