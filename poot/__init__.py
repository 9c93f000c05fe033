"""poot: a conformance suite for continuous-batching LLM servers, and a reference server.

The code lives in top-level folders mapped under this namespace:
engine/ -> poot.engine, server/ -> poot.server, conformance/ -> poot.conformance,
loadtests/ -> poot.loadtests.
"""

__version__ = "0.1.0"
