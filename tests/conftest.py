"""Shared fixtures: the devices every property runs on, and hypothesis profiles.

Each property test takes the ``device`` fixture and runs once on the CPU and
once on the XLA device (``PJRT_DEVICE=CPU``). Without torch_xla the XLA run is
skipped, except when ``MPFUNC_REQUIRE_XLA=1`` (set by scripts/test.sh and CI),
where a missing XLA backend fails the run instead of hiding.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("PJRT_DEVICE", "CPU")

# Start the XLA runtime before any test runs autograd: torch's autograd engine sizes
# its per-device queues at its first backward, from the devices registered then, and
# an XLA backward after a CPU one otherwise trips an internal assert
# (device_ready_queues_) in torch 2.9 / torch_xla 2.9. Training scripts that touch
# the XLA device before their first backward never see it.
with contextlib.suppress(ImportError):
    import torch_xla

    torch_xla.device()

# XLA compiles a new graph for every new tree shape, so examples are slow and
# their timing is meaningless: no deadline. Example counts are set per test.
settings.register_profile(
    "mpfunc",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=os.environ.get("CI") == "true",
    print_blob=True,
)
settings.load_profile("mpfunc")


def _xla_device() -> torch.device | None:
    try:
        import torch_xla
    except ImportError:
        return None
    return torch.device(torch_xla.device())


def require_xla() -> torch.device:
    dev = _xla_device()
    if dev is None:
        if os.environ.get("MPFUNC_REQUIRE_XLA") == "1":
            pytest.fail("torch_xla is required (MPFUNC_REQUIRE_XLA=1) but does not import")
        pytest.skip("torch_xla is not installed")
    return dev


@pytest.fixture(params=["cpu", pytest.param("xla", marks=pytest.mark.xla)])
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """Runs the test on the CPU and on the XLA device."""
    if request.param == "cpu":
        yield torch.device("cpu")
    else:
        yield require_xla()


@pytest.fixture
def xla_device() -> torch.device:
    return require_xla()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Run the CPU half of the suite before XLA, so quick failures surface first.
    items.sort(key=lambda it: "[xla" in it.nodeid)
