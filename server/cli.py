"""`poot-serve`: starts the reference server.

The server listens at once and loads the model on a background thread; /health answers 503
"loading" until the engine is ready. SIGTERM or SIGINT starts a drain: /health answers 503
"draining", new generation requests get 503, requests in flight run to their end, and then
the process exits 0. A second signal stops waiting.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# The engine thread holds the GIL through each step's Python; the event loop, waking on a
# socket event (a hang-up), waits for it up to the interpreter's switch interval (5 ms by
# default) at every hop, several of which lie between a client's hang-up and the request's
# cancellation. A short interval keeps that notice within about one engine step.
SWITCH_INTERVAL_S = 0.0005
MAX_STEP_DELAY_S = 1.0  # --step-delay (test-only) slows steps; it never changes the plan


def build_parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    from poot.engine.drivers import BACKENDS

    p = cls(
        prog="poot-serve", allow_abbrev=False,
        description="OpenAI-compatible server over the poot engine (one scheduling loop, paged KV).")
    p.add_argument("--model", default=None,
                   help='model to serve: a file or folder, "synthetic" or "synthetic:SEED" for the tiny '
                        "generated model; default: the SmolLM2 default model")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="compute backend (default: auto)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--draft", default="none", choices=("none", "ngram"),
                   help="speculative draft policy (default: none)")
    p.add_argument("--fault-injection", action="store_true",
                   help="enable POST /debug/fault to make the engine refuse a step, fault or panic (tests only)")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="require this file's key as a bearer token on every request but /health and /metrics "
                        "(default: the POOT_API_KEY environment variable; no key: open to all)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log level (default: info)")
    p.add_argument("--retune", action="store_true",
                   help="measure this machine afresh (the CPU driver's product choices) instead of reading what an "
                        "earlier start measured, and keep the new measurement: after a change of load, BIOS or "
                        "hardware that the cache cannot see")
    p.add_argument("--responses-max-count", type=int, default=1000, metavar="N",
                   help="stored /v1/responses kept in memory at most, the oldest out first (default: 1000)")
    p.add_argument("--responses-max-bytes", type=int, default=64 << 20, metavar="BYTES",
                   help="bytes of stored /v1/responses kept in memory at most, the oldest out first "
                        "(default: 67108864, 64 MiB)")
    # Test-only, hidden: sleep this many seconds before each driver step, so that steps of the
    # tiny synthetic model last long enough to be watched (cancellation, draining, faults). It
    # wraps the driver's step and nothing else: rows, positions and blocks are still fitted by
    # the plan from the device and the model alone.
    p.add_argument("--step-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def fail(message: str, code: int = 2) -> int:
    print(f"poot-serve: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None,
         state_class=None, app_factory=None, key_guard=None) -> int:
    """Runs the server. `parser`, `state_class` (a ServerState), `app_factory` (state -> ASGI
    app) and `key_guard` (a RequireKey, put around the app when a key is set) are the parts it
    is built from; by default this module's parser and the app's and auth's own."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)  # an unknown option exits 2, before anything loads

    from poot.engine.models.base import ModelLoadError

    from . import loading
    if not 0 <= args.step_delay <= MAX_STEP_DELAY_S:  # also refuses nan
        return fail(f"--step-delay must be between 0 and {MAX_STEP_DELAY_S} seconds")
    if args.responses_max_count < 0 or args.responses_max_bytes < 0:
        return fail("--responses-max-count and --responses-max-bytes must not be negative")
    from .auth import ApiKeyError, RequireKey, read_key
    from .start_line import StartLine, is_terminal

    try:
        api_key = read_key(args.api_key_file)
    except ApiKeyError as e:
        return fail(str(e))
    try:
        loading.precheck(args.model)
    except ModelLoadError as e:
        return fail(f"cannot load the model: {e}", 1)

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Before any logging is set up: on a terminal the log's streams are shared with the line.
    line, console = StartLine(sys.stderr), (sys.stdout, sys.stderr)
    sys.stderr = line.share(sys.stderr)
    if is_terminal(sys.stdout):  # the access log, on the same screen
        sys.stdout = line.share(sys.stdout)
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .app import build_app
    from .state import ServerState

    state = (state_class or ServerState)(model_spec=args.model, backend=args.backend,
                                         draft=None if args.draft == "none" else args.draft,
                                         fault_injection=args.fault_injection, step_delay=args.step_delay,
                                         retune=args.retune, responses_max_count=args.responses_max_count,
                                         responses_max_bytes=args.responses_max_bytes)
    line.follow(state.progress)
    app = (app_factory or build_app)(state)
    if api_key:
        app = (key_guard or RequireKey)(app, api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            lifespan="on", timeout_graceful_shutdown=5)
    server = DrainingServer(config, state)
    state.request_exit = server.exit_now
    try:
        server.run()
    finally:
        sys.stdout, sys.stderr = console
    return state.exit_code


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the socket at once."""

    def __init__(self, config, state):
        super().__init__(config)
        self.state = state

    def exit_now(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the
        # process would die of the signal instead of exiting 0.
        log = logging.getLogger("poot.server")
        state = self.state
        if state.draining or state.engine is None:
            if state.draining:
                log.warning("second %s: stopping without waiting", signal.Signals(sig).name)
                self.force_exit = True
            self.should_exit = True
            return
        state.begin_drain()
        log.info("%s: draining %d request(s) in flight", signal.Signals(sig).name, state.engine.in_flight())


if __name__ == "__main__":
    sys.exit(main())
