"""The SmolLM2 fixture, shared with the model tests."""

from tests.models.conftest import smollm2  # noqa: F401
