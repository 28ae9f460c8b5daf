"""Server telemetry over a phase (``bench serve --metrics-interval``): the target's /metrics
as a time series, this machine's GPUs through NVML (a fake ``pynvml`` module here: this
machine has none), the result's ``telemetry`` section and the report's table and plot.
Against the embedded server: tests/bench/test_bench_serve.py's cold and warm phases."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest
from aiohttp import web

from aphrodite_cli.bench.load import scrape
from aphrodite_cli.bench.load.gpu_telemetry import GpuSampler
from aphrodite_cli.bench.load.telemetry import Telemetry, select
from aphrodite_cli.bench.results.files import load_result
from aphrodite_cli.bench.results.report import write_report
from engine.errors import ConfigError
from tests.bench.test_report import serve_result


def fake_nvml(*, devices: int = 2, init_error: bool = False, decoder: bool = True
              ) -> types.ModuleType:
    """A ``pynvml`` with the calls GpuSampler makes: GPU i's utilisation is 10 * (i + 1)
    plus the number of readings so far, its decoder 5 * (i + 1); ``calls`` counts them."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nvml.NVMLError = NVMLError
    nvml.calls = {"init": 0, "shutdown": 0, "util": 0}

    def init() -> None:
        nvml.calls["init"] += 1
        if init_error:
            raise NVMLError("Driver Not Loaded")

    def util(handle: int) -> types.SimpleNamespace:
        nvml.calls["util"] += 1
        return types.SimpleNamespace(gpu=10 * (handle + 1) + nvml.calls["util"], memory=3)

    def dec(handle: int) -> list[int]:
        if not decoder:
            raise NVMLError("Not Supported")
        return [5 * (handle + 1), 167000]

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.__setitem__("shutdown", nvml.calls["shutdown"] + 1)
    nvml.nvmlDeviceGetCount = lambda: devices
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    nvml.nvmlDeviceGetUtilizationRates = util
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=141 << 30,
                                                                   used=(h + 1) << 30)
    nvml.nvmlDeviceGetDecoderUtilization = dec
    nvml.nvmlDeviceGetEncoderUtilization = lambda h: [0, 167000]
    return nvml


def test_nvml_readings_per_gpu_and_none_for_what_a_gpu_does_not_support(monkeypatch):
    nvml = fake_nvml(decoder=False)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpu = GpuSampler()
    assert gpu.open() is None
    assert gpu.devices == [{"index": i, "name": "NVIDIA H200",
                            "memory_total_bytes": 141 << 30} for i in range(2)]
    first, second = gpu.sample()
    assert first == {"index": 0, "gpu_util_pct": 11.0, "memory_util_pct": 3.0,
                     "memory_used_bytes": 1 << 30, "decoder_util_pct": None,
                     "encoder_util_pct": 0.0}
    assert second["gpu_util_pct"] == 22.0 and second["memory_used_bytes"] == 2 << 30
    gpu.close()
    assert nvml.calls["shutdown"] == 1


@pytest.mark.parametrize(("module", "says"), [
    (None, "nvidia-ml-py (pynvml) is not installed"),
    (fake_nvml(init_error=True), "NVML could not start (Driver Not Loaded)"),
    (fake_nvml(devices=0), "NVML found no GPU"),
])
def test_no_gpu_is_a_reason_not_an_error(monkeypatch, module, says):
    monkeypatch.setitem(sys.modules, "pynvml", module)  # None: the import fails
    assert GpuSampler().open() == says


def test_the_series_sum_label_sets_average_percentages_and_take_vllms_names_first():
    values, names = select({
        'vllm:num_requests_running{engine="0"}': 2.0, 'vllm:num_requests_running{engine="1"}':
        3.0, 'vllm:kv_cache_usage_perc{engine="0"}': 0.2,
        'vllm:kv_cache_usage_perc{engine="1"}': 0.4, "vllm:gpu_cache_usage_perc": 0.9,
        "vllm:prompt_tokens_total": 100.0, "aphrodite_engine_num_rows_running": 4.0,
        "aphrodite_engine_num_rows_waiting": float("nan"),  # the engine did not answer
        "something_else": 1.0})
    assert values == {"num_requests_running": 5.0, "kv_cache_usage_perc": pytest.approx(0.3),
                      "prompt_tokens": 100.0, "engine_rows_running": 4.0}
    assert names["kv_cache_usage_perc"] == "vllm:kv_cache_usage_perc"


async def test_a_phase_is_sampled_at_its_interval_with_the_gpus(aiohttp_server, monkeypatch):
    """A target whose gauges and counters move: the series has a sample at the start, one
    per tick and one at the end, in time order, with the values the target showed; the
    fake GPUs are read at each tick. A target without /metrics: unavailable, with why."""
    scrapes = {"n": 0}

    async def metrics(request: web.Request) -> web.Response:
        scrapes["n"] += 1
        n = scrapes["n"]
        return web.Response(text=(
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {n}\n'
            "# TYPE vllm:generation_tokens counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {10 * n}\n'))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(devices=1))
    telemetry = Telemetry(f"http://127.0.0.1:{server.port}", 0.1)
    await telemetry.start()
    await asyncio.sleep(0.45)
    await telemetry.stop()
    result = telemetry.result()
    samples = result["metrics"]["samples"]
    assert result["metrics"]["available"] and len(samples) == scrapes["n"] >= 4
    times = [s["t_s"] for s in samples]
    assert times == sorted(times) and len(set(times)) == len(times) and times[0] < 0.1
    assert [s["num_requests_running"] for s in samples] == list(range(1, len(samples) + 1))
    assert samples[-1]["generation_tokens"] == 10 * len(samples)
    assert result["metrics"]["series"] == {"generation_tokens": "vllm:generation_tokens_total",
                                           "num_requests_running": "vllm:num_requests_running"}
    gpu = result["gpu"]
    assert gpu["available"] and gpu["devices"][0]["name"] == "NVIDIA H200"
    assert [s["t_s"] for s in gpu["samples"]] == times
    assert [s["gpus"][0]["gpu_util_pct"] for s in gpu["samples"]] == [
        10.0 + k for k in range(1, len(times) + 1)]
    assert gpu["samples"][0]["gpus"][0]["decoder_util_pct"] == 5.0

    monkeypatch.setitem(sys.modules, "pynvml", None)
    async def endless(request: web.Request) -> web.Response:
        return web.Response(text="x_total 1\n" * 200)

    odd = web.Application()
    odd.router.add_get("/metrics", endless)
    for app, reason in ((web.Application(), "GET /metrics answered HTTP 404"),
                        (odd, "GET /metrics is over 1000 bytes")):  # an endless one, cut
        monkeypatch.setattr(scrape, "MAX_METRICS_BYTES", 1000)
        target = await aiohttp_server(app)
        telemetry = Telemetry(f"http://127.0.0.1:{target.port}", 0.1)
        await telemetry.start()
        await telemetry.stop()
        result = telemetry.result()
        assert result["metrics"] == {"available": False, "failed_scrapes": 2,
                                     "reason": reason}
        assert result["gpu"] == {"available": False,
                                 "reason": "nvidia-ml-py (pynvml) is not installed"}


def test_the_report_shows_the_series_and_old_results_still_report(tmp_path):
    path = serve_result(tmp_path / "serve-t.json")
    doc = json.loads(path.read_text())
    doc["phases"]["cold"]["telemetry"] = {
        "interval_s": 1.0,
        "metrics": {"available": True, "failed_scrapes": 0, "samples": [
            {"t_s": float(t), "num_requests_running": float(t % 3),
             "prompt_tokens": 100.0 * t, "generation_tokens": 20.0 * t} for t in range(5)]},
        "gpu": {"available": True, "devices": [{"index": 0, "name": "NVIDIA H200"}],
                "samples": [{"t_s": float(t), "gpus": [{
                    "index": 0, "gpu_util_pct": 50.0 + t, "memory_util_pct": 1.0,
                    "memory_used_bytes": 2e9 * (t + 1), "decoder_util_pct": 10.0,
                    "encoder_util_pct": 0.0}]} for t in range(5)]}}
    doc["phases"]["warm"]["telemetry"] = {
        "interval_s": 1.0, "metrics": {"available": False, "reason": "GET /metrics answered "
                                                                     "HTTP 404"},
        "gpu": {"available": False, "reason": "NVML found no GPU"}}
    path.write_text(json.dumps(doc))
    assert load_result(path)["phases"]["cold"]["telemetry"]["interval_s"] == 1.0
    _, md_path = write_report([path], tmp_path / "rep")
    md = md_path.read_text()
    assert "**cold: telemetry every 1 s**" in md and "5 scrapes over 4 s" in md
    assert "| num_requests_running | 0.8 / 2 | - |" in md
    assert "| prompt_tokens | - | 100 |" in md  # a counter's rate
    assert "| 0: NVIDIA H200 | 52 / 54 | 10 | 10 / 10 | 0 / 0 |" in md
    assert "server /metrics: unavailable (GET /metrics answered HTTP 404)" in md
    assert "GPU: not sampled (NVML found no GPU)" in md
    assert len(list((tmp_path / "rep").glob("plot-*.png"))) == 4  # 3 as before + telemetry
    for broken, says in (({"t_s": 1.0, "gpus": "x"}, "gpus"), ({"gpus": []}, "t_s")):
        doc["phases"]["cold"]["telemetry"]["gpu"]["samples"][0] = broken
        path.write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match=says):  # refused by field, not misreported
            load_result(path)
    old = serve_result(tmp_path / "serve-old.json")
    _, md_path = write_report([old], tmp_path / "rep-old")
    assert "telemetry" not in md_path.read_text()
    assert len(list((tmp_path / "rep-old").glob("plot-*.png"))) == 3
