"""What the routes share: the engine once loaded, and whether the server still takes requests."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from poot.engine.progress import Progress

from . import loading
from .background import yielding_pool
from .loop_lag import LoopLag
from .openai import ApiError
from .response_store import ResponseStore

COMPILE_THREADS = 2  # grammars compiled at once
log = logging.getLogger("poot.server")


class ServerState:
    """Everything the routes share. `engine` is None until the model has loaded."""

    def __init__(self, model_spec: str | None = None, backend: str = "auto", draft: str | None = None,
                 fault_injection: bool = False, step_delay: float = 0.0, retune: bool = False,
                 responses_max_count: int = 1000, responses_max_bytes: int = 64 << 20):
        self.model_spec = model_spec
        self.retune = retune  # the driver measures the machine afresh (--retune)
        self.backend = backend
        self.draft = draft
        self.fault_injection = fault_injection
        self.step_delay = step_delay
        self.engine = None
        self.model = None
        self.model_names: tuple[str, ...] = ()
        self.created = int(time.time())
        self.draining = False
        self.active = 0  # generation requests the app has not finished answering
        self.exit_code = 0
        self.request_exit = lambda: None  # set by the CLI: makes uvicorn shut down
        self.loop_lag = LoopLag()  # how late the event loop wakes (server/loop_lag.py)
        self.progress = Progress()  # what the start is doing, until the engine is ready
        self.grammars = None  # engine.grammar.Grammars of the served tokenizer, once the model is loaded
        self.responses = ResponseStore(responses_max_count, responses_max_bytes)  # stored /v1/responses
        self.requests = Counter()  # generation requests by endpoint, for /metrics
        # Grammars are compiled off the event loop and off the engine thread; the long native
        # part of each runs below the engine's priority (server/background.py).
        self.compiling = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="poot-grammar")
        self.yielding = yielding_pool(COMPILE_THREADS, "poot-grammar-start")

    # ---- loading (runs on its own thread while the server already answers /health) ----

    def load(self) -> None:
        from poot.engine.models.base import ModelLoadError

        try:
            # The backend is chosen (`auto` probes the machine's devices) and the driver does
            # what needs no model (the CPU driver loads its compiled kernels) while the model loads.
            with ThreadPoolExecutor(1, thread_name_prefix="poot-driver") as pool:
                driver = pool.submit(self.ready_driver)
                model = loading.load_model(self.model_spec, self.progress)
                driver = driver.result()
                # Constrained decoding's view of the vocabulary is built while the engine
                # prepares: building it holds the GIL for a few hundred milliseconds, which
                # would stall every stream if the first response_format request did it.
                grammars = pool.submit(self.grammars_for, model, self.yielding)
                engine = self.make_engine(model, driver)
                grammars = grammars.result()
            engine.start()
        except ModelLoadError as e:
            self.fatal(f"poot-serve: cannot load the model: {e}")
        except Exception as e:  # a plan that does not fit, a driver that cannot start, ...
            self.fatal(f"poot-serve: cannot start the engine: {type(e).__name__}: {e}")
        else:
            self.model = model
            self.grammars = grammars
            names = [model.name]
            if self.model_spec and self.model_spec != model.name:
                names.append(self.model_spec)
            self.model_names = tuple(names)
            self.engine = engine  # last: from here on the server is ready
            self.progress.finish("ready")
            log.info("ready: model %s, plan %s", model.name, engine.plan.as_dict())

    def make_driver(self):
        from poot.engine.drivers import make_driver

        driver = make_driver(self.backend)
        driver.retune = self.retune
        return slowed(driver, self.step_delay) if self.step_delay > 0 else driver

    def ready_driver(self):
        """make_driver()'s driver, reporting to this start's progress, preloaded."""
        driver = self.make_driver()
        driver.progress = self.progress
        driver.preload()
        return driver

    @staticmethod
    def grammars_for(model, yielding=None):
        """The model's constrained-decoding grammars (engine/grammar.py), vocabulary built;
        the long part of each compile run on `yielding` (an executor), where given."""
        from poot.engine.grammar import Grammars
        from poot.engine.params import InvalidRequest

        start = None if yielding is None else (lambda work: yielding.submit(work).result())
        grammars = Grammars(model.tokenizer, start)
        try:
            grammars.tokenizer()
        except InvalidRequest as e:  # a model file's vocabulary is untrusted input
            log.warning("%s", e)
        return grammars

    def make_engine(self, model, driver=None):
        """The engine over `driver` (default: a new one from make_driver())."""
        from poot.engine import Engine

        return Engine.create(model, draft=self.draft, driver=driver or self.make_driver(), progress=self.progress)

    def matchers(self, constraint, count: int) -> list:
        """A fresh grammar matcher per choice for `constraint` (an openai.ResponseFormat, or a
        tools.ToolUse), its grammar compiled once and kept. Runs on a worker thread;
        InvalidRequest naming the field for what cannot be compiled."""
        from poot.engine.grammar import JSON_OPTIONS

        from .openai import ResponseFormat

        g = self.grammars
        if not isinstance(constraint, ResponseFormat):
            grammar = g.lark(constraint.grammar(JSON_OPTIONS), "tools")
        elif constraint.kind == "json_object":
            grammar = g.json_object()
        else:
            grammar = g.json_schema(constraint.schema)
        return [grammar.matcher() for _ in range(count)]

    def loading_body(self) -> dict:
        """What /health says while the engine is not ready yet: the start's current stage."""
        return self.progress.now.as_dict()

    def fatal(self, line: str) -> None:
        self.progress.finish("failed")
        print(line.replace("\n", " "), file=sys.stderr, flush=True)
        self.exit_code = 1
        self.request_exit()

    # ---- availability -----------------------------------------------------------------

    def accepting(self) -> bool:
        """Whether new generation requests are taken: not once draining has begun."""
        return not self.draining

    def serving_engine(self):
        engine = self.engine
        if engine is None:
            raise ApiError(503, "the model is still loading", code="loading")
        h = engine.health()
        if h.status != "ok":
            raise ApiError(503, f"the engine is dead ({h.cause}): {h.reason}", code="engine_dead")
        if not self.accepting():
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining")
        return engine

    # ---- draining -----------------------------------------------------------------------

    def begin_drain(self) -> None:
        """New requests get 503 from now on; the ones in flight run to their end."""
        self.draining = True

    def drained(self) -> None:
        """Nothing is in flight any more: the server shuts down and exits 0."""
        log.info("drained: shutting down")
        self.request_exit()


def slowed(driver, delay: float):
    """Test-only (--step-delay): the driver sleeps before each step, so steps are slow enough to
    watch. Only `step` is wrapped: the device the plan is fitted to is the driver's own, so
    rows, positions and blocks are the same as without it."""
    step = driver.step

    def slow_step(batch):
        time.sleep(delay)
        return step(batch)

    driver.step = slow_step
    return driver
