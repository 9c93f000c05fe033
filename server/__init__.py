"""The reference server: an OpenAI-compatible HTTP front for the engine (`poot-serve`)."""
