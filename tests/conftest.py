"""Shared fixtures: a loopback media server with a hit counter, policies, generated media."""

from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import HealthCheck, settings

from engine.config import MediaLimits, MediaPolicy
from tests.media_server import MediaServer, build_app

GPU_ENV = "APHRODITE_FAIL_WITHOUT_GPU"

# Property tests: the suite (`make test`, CI) always draws the same examples, so a run is green
# or red for the code, never for the seed; exploration with fresh seeds is `make fuzz`
# (scripts/fuzz.sh), and whatever it finds is pinned here as an @example. Select with
# `--hypothesis-profile fuzz` (pytest) or HYPOTHESIS_PROFILE=fuzz.
settings.register_profile("suite", derandomize=True, database=None, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", derandomize=False, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


def _has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidiactl")


def pytest_collection_modifyitems(config, items):
    """Skip tests whose capability is missing, unless APHRODITE_FAIL_WITHOUT_GPU=1 says
    the GPU must be there (then they run and fail loudly)."""
    must_have_gpu = os.environ.get(GPU_ENV, "") not in ("", "0")
    checks = {
        "needs_gpu": (_has_nvidia_gpu, "no NVIDIA GPU"),
        "needs_ffmpeg_cli": (lambda: shutil.which("ffmpeg") is not None, "no ffmpeg CLI"),
        "needs_browser": (lambda: shutil.which("chromium") is not None, "no chromium"),
    }
    for item in items:
        for marker, (present, why) in checks.items():
            if item.get_closest_marker(marker) and not present():
                if marker == "needs_gpu" and must_have_gpu:
                    continue
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
async def media_server(aiohttp_server) -> MediaServer:
    """A real HTTP media server on 127.0.0.1 with a hit counter."""
    state = MediaServer()
    server = await aiohttp_server(build_app(state))
    state.base_url = f"http://127.0.0.1:{server.port}"
    return state


@pytest.fixture
def loopback_policy() -> MediaPolicy:
    """A policy that allows the loopback media server by listing its host."""
    return MediaPolicy.create(allowed_domains=["127.0.0.1"])


@pytest.fixture
def limits() -> MediaLimits:
    return MediaLimits.from_env()
