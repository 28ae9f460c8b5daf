"""``bench decode-step``: the engine's decode step against the memory-bandwidth floor.

A decode step reads every weight of the language model once (its products are a few rows
against each weight) and every row's keys and values: on a CPU its least possible time is
those bytes over the machine's read bandwidth. Here, on one loaded model, for each batch size
and context length:

- the rows are prefilled (text prompts, not timed), then stepped by ``runner.decode``, the
  step the engine runs between its scheduling decisions (the lean decode step where the
  model has one, sampling and bookkeeping included): ``warmups`` steps, then ``repeats``
  timed ones, centred on the context length (the middle timed step starts with
  ``context_len`` tokens in each row's cache);
- the bytes that step must read: the language model's weights (its input embedding table
  only as far as the step's rows read it, unless it is also the output head) plus the keys
  and values of ``context_len + 1`` columns per row;
- the machine's read bandwidth on the same torch threads: a sum over a float32 tensor several
  times the last-level cache, read before each timed step of the configuration (an untimed
  step between them) and between configurations, for the run's own figure.

``floor_ms`` is bytes over the median bandwidth read beside that configuration's steps (a
shared machine's bandwidth drifts over a run: a floor from the run's median alone moved a
configuration's ratio by 20% from one run to the next); ``ratio_to_floor`` the median step
over it.

With ``compile_decode`` the model is loaded with ``--compile-decode``, its compiles awaited
(their time recorded), and each configuration timed twice in turn on the same model: the
eager lean step (``compiled`` false) and the compiled one (``compiled`` true, ``vs_eager``
its step over the eager one's), a step of each in turn on the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.results.stats import summary

#: the least the bandwidth probe reads, and its size in last-level caches
MIN_READ_BYTES = 256 << 20
LLC_MULTIPLE = 4
#: probe samples taken before the first configuration and after each one
PROBE_SAMPLES = 3
#: tokens of each prompt's greedy continuation the quality comparison reads
QUALITY_TOKENS = 32
_TEXT = "The quick brown fox jumps over the lazy dog while the model keeps on reading. "


def llc_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of this CPU's last-level cache (sysfs), or None where it is not told."""
    best: tuple[int, int] | None = None
    for index in root.glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    return best[1] if best else None


def read_bytes_default() -> int:
    """What the bandwidth probe reads: ``LLC_MULTIPLE`` last-level caches, at least
    ``MIN_READ_BYTES``."""
    return max(MIN_READ_BYTES, LLC_MULTIPLE * (llc_bytes() or 0))


def read_bandwidth(buffer: Any, samples: int) -> list[float]:
    """GB/s of ``samples`` full reads of ``buffer`` (a float32 tensor) by a sum, on this
    thread's torch threads."""
    rates = []
    for _ in range(samples):
        start = time.perf_counter()
        buffer.sum()
        rates.append(buffer.numel() * buffer.element_size() / (time.perf_counter() - start)
                     / 1e9)
    return rates


def weight_bytes(model: Any, rows: int) -> int:
    """Bytes of weights a decode step of ``rows`` rows reads: the language model's
    parameters (int8 rows and their scales for a quantized layer) and the output
    head's, each tensor once; the input embedding table only as
    ``rows`` of its rows when it is not the head's weight."""
    from engine.models import parts

    text = parts.language_model(model) or model
    head = model.get_output_embeddings()
    embed = text.get_input_embeddings().weight
    packed = [t for m in text.modules() if getattr(m, "qweight", None) is not None
              for t in (m.qweight, m.scale)]  # (--quantization int8: rows and scales)
    tensors = {p.data_ptr(): p for p in [*text.parameters(), *packed, *head.parameters()]}
    total = sum(p.numel() * p.element_size() for p in tensors.values())
    if embed.data_ptr() != head.weight.data_ptr():
        total -= embed.numel() * embed.element_size()
        total += rows * embed.shape[-1] * embed.element_size()
    return total


def kv_bytes(cache: Any, columns: int) -> int:
    """Bytes of keys and values a step reads over ``columns`` columns of every row."""
    total = 0
    for layer in cache.layers:
        rows, heads, _, dim = layer.keys.shape
        total += 2 * rows * heads * columns * dim * layer.keys.element_size()
    return total


def _requests(llm: Any, rows: int, prompt_tokens: int, steps: int) -> list[Any]:
    from engine import SamplingParams
    from engine.executor.request import CompletionOutput, EngineRequest
    from engine.processing.preprocess import ProcessedPrompt

    ids = llm.loaded.tokenizer(_TEXT, add_special_tokens=False)["input_ids"]
    ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    out = []
    for _ in range(rows):
        prompt = ProcessedPrompt(list(ids), {}, [], {}, {})
        req = EngineRequest(prompt, SamplingParams(max_tokens=steps + 2, temperature=0,
                                                   ignore_eos=True))
        req.outputs = [CompletionOutput(0)]
        out.append(req)
    return out


def _one(llm: Any, rows: int, context: int, warmups: int, repeats: int,
         variants: tuple[bool | None, ...] = (None,),
         probe: Callable[[], float] | None = None) -> list[dict[str, Any]]:
    """The configuration timed on each of ``variants`` (None: the step as loaded; False and
    True: ``--compile-decode``'s step eager and compiled), one step of each in turn on the
    same rows (each sees the same contexts and the same moments of the machine's load);
    ``probe`` (GB/s of one bandwidth read) before each timed round, their summary in each
    row's ``bandwidth_gb_s``, and an untimed step after it (a step right after the probe's
    read ran 5% slower on two threads than one after a step, as a busy server's are)."""
    from engine.executor.outputs import finish_row

    runner = llm.engine.runner
    per_round = len(variants) + (probe is not None)
    steps = (warmups + repeats) * per_round
    prompt_tokens = context - (warmups + repeats // 2) * per_round
    batch = runner.prefill_requests(_requests(llm, rows, prompt_tokens, steps))
    times: list[list[float]] = [[] for _ in variants]
    rates: list[float] = []
    for n in range(warmups + repeats):
        if probe is not None:
            if n >= warmups:
                rates.append(probe())
            runner.decode(batch)  # (untimed: see above; in warm-ups too, as the contexts move)
        for i, on in enumerate(variants):
            if on is not None:
                runner._lean_decode.enabled = on
            start = time.perf_counter()
            runner.decode(batch)
            if n >= warmups:
                times[i].append((time.perf_counter() - start) * 1e3)
    weights = weight_bytes(runner.model, rows)
    kv = kv_bytes(batch.cache, context + 1)
    for row in batch.rows:
        finish_row(row, "abort")
    return [{"batch_size": rows, "context_len": context, "step_ms": summary(t),
             "weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv,
             **({"bandwidth_gb_s": summary(rates)} if rates else {}),
             **({} if on is None else {"compiled": on})}
            for on, t in zip(variants, times, strict=True)]


def _graphs_compiled() -> int:
    """Graphs ``torch.compile`` made so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiles(llm: Any, timeout_s: float) -> dict[str, Any]:
    """Wait for ``--compile-decode``'s compiles of ``llm``'s step; what they took."""
    from engine.errors import ConfigError

    step, path = llm.engine.runner._lean_decode, llm.engine.runner.decode_path
    if not hasattr(step, "wait"):
        why = "the model's own forward runs it" if path == "forward" else "the log says why"
        raise ConfigError(f"--compile-decode: this model's decode step is not compiled ({why})",
                          hint="leave out --compile-decode for this model",
                          code="invalid_flag")
    start = time.perf_counter()
    if not step.wait(timeout_s):
        raise ConfigError(f"--compile-decode: the compiles did not end in {timeout_s:.0f} s",
                          hint="run it on a less busy machine, or with fewer --batch-sizes",
                          code="invalid_flag")
    return {"wait_s": time.perf_counter() - start, "buckets": sorted(step.ready),
            "error": step.error}


def run_decode_step(model: str | None, *, batch_sizes: list[int], context_lens: list[int],
                    num_threads: int, warmups: int, repeats: int,
                    read_bytes: int | None = None, quantization: str | None = None,
                    quality_tokens: int = QUALITY_TOKENS, compile_decode: bool = False,
                    compile_timeout_s: float = 1800) -> dict[str, Any]:
    """The result (see the module's text); with ``quantization``, the model loaded twice, as
    it is and quantized, each configuration timed on both in turn (rows carry
    ``quantization``: ``"none"`` or the method; the quantized ones ``vs_unquantized``, their
    step over the other's), and the quantized one's quality against the other's
    (:mod:`aphrodite_cli.bench.offline.quant_quality`); with ``compile_decode`` (not beside
    ``quantization``) each configuration on the eager and the compiled step in turn."""
    import torch

    from engine import LLM
    from engine.cpus import use_torch_threads
    from engine.models import decode_kernels

    settings = dict(num_threads=num_threads, max_num_seqs=max(batch_sizes),
                    enable_prefix_caching=False, encoder_cache_gb=0, mm_processor_cache_gb=0)
    llms = {"none": LLM(model, compile_decode=compile_decode, **settings)}
    try:
        compiled = _compiles(llms["none"], compile_timeout_s) if compile_decode else None
        if quantization is not None:
            llms[quantization] = LLM(model, quantization=quantization, **settings)
        use_torch_threads(num_threads)  # (the engine's own thread keeps its count)
        nbytes = read_bytes or read_bytes_default()
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)
        buffer.sum()  # (its pages touched)
        rates = read_bandwidth(buffer, PROBE_SAMPLES)

        def probe() -> float:  # (one read beside a configuration's steps, in the run's too)
            rates.append(read_bandwidth(buffer, 1)[0])
            return rates[-1]

        rows = []
        graphs = _graphs_compiled()
        for context in context_lens:
            for size in batch_sizes:
                for name, llm in llms.items():
                    rows += [{"quantization": name, **r} for r in _one(
                        llm, size, context, warmups, repeats,
                        (False, True) if compiled is not None else (None,), probe=probe)]
                rates += read_bandwidth(buffer, PROBE_SAMPLES)
        buffer = None  # (its memory back before the quality comparison)
        bandwidth = summary(rates)
        plain = {(r["batch_size"], r["context_len"]): r["step_ms"]["median"] for r in rows
                 if r["quantization"] == "none" and not r.get("compiled")}
        for row in rows:
            beside = row.get("bandwidth_gb_s", bandwidth)["median"]
            floor_ms = row["bytes"] / (beside * 1e9) * 1e3
            step = row["step_ms"]["median"]
            row.update(floor_ms=floor_ms, ratio_to_floor=step / floor_ms,
                       achieved_gb_s=row["bytes"] / (step / 1e3) / 1e9)
            if row["quantization"] != "none":
                row["vs_unquantized"] = step / plain[(row["batch_size"], row["context_len"])]
            if row.get("compiled"):
                row["vs_eager"] = step / plain[(row["batch_size"], row["context_len"])]
        runner = llms["none"].engine.runner
        doc = {"model": llms["none"].loaded.name, "num_threads": num_threads,
               "decode_path": runner.decode_path,
               "decode_attention": "kernel" if decode_kernels.library() else "batched products",
               # floats per vector the kernels were built with (the CPU's register width)
               "decode_kernel_vector_floats": getattr(decode_kernels.prepare(),
                                                      "vector_floats", None),
               "decode_linear_kernel_products": getattr(runner._lean_decode,
                                                        "kernel_products", 0),
               # the layers in one call into the kernels (engine/models/decode_layers.py)
               "decode_layers_in_one_call": getattr(runner._lean_decode, "whole",
                                                    None) is not None,
               # (each loaded model's: with --quantization, its int8 products' too)
               "decode_linear_kernel_products_by_quantization": {
                   name: getattr(llm.engine.runner._lean_decode, "kernel_products", 0)
                   for name, llm in llms.items()},
               "warmups": warmups, "repeats": repeats,
               "parameters": sum(p.numel() for p in runner.model.parameters()),
               "bandwidth": {"gb_s": bandwidth, "read_bytes": nbytes,
                             "llc_bytes": llc_bytes(), "method": "float32 sum"},
               "rows": rows}
        if compiled is not None:  # (a bucket compiled but compiling again in a step: a bug)
            doc["compile"] = {**compiled,
                              "graphs_compiled_in_steps": _graphs_compiled() - graphs}
        if quantization is not None:
            from aphrodite_cli.bench.offline import quant_quality

            ref = quant_quality.reference(llms["none"], quality_tokens)
            doc["quality"] = {quantization: quant_quality.compare(llms[quantization], ref)}
        return doc
    finally:
        for llm in llms.values():
            llm.close()
