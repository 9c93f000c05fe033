"""The SmolLM2 fixture, shared with the model tests, and where the kernels' tests launch them."""

from tests.drivers.kernel_runners import runner  # noqa: F401
from tests.models.conftest import smollm2  # noqa: F401
