"""Replay of a Mooncake trace (``--dataset-name mooncake``, or vLLM's ``timed_trace``): one
JSON object per line with ``timestamp``, ``input_length``, ``output_length`` and ``hash_ids``,
the format Mooncake published and vLLM, SGLang and AIPerf replay.

Each hash id stands for one block of ``--timed-trace-chunk-hash-size`` tokens (512 here, as
Mooncake's traces were cut; vLLM's default is 16, which makes a Mooncake prompt 32 times too
short): equal ids are equal token blocks, in this run, so a prefix cache meets the reuse the
trace recorded. A prompt is its blocks in order, the last one cut to what ``input_length``
leaves (a line whose ids do not cover its length at that block size is refused: the block size
is wrong). Blocks are written in the tokenizer's tokens (see
:mod:`~aphrodite_cli.bench.load.token_prompts`), so the text is ``input_length`` tokens; a chat
endpoint adds its template's tokens in front (recorded in the result), ``/v1/completions``
counts the text alone.

``timestamp`` is in milliseconds (Mooncake's unit): a request is sent ``(timestamp - the
first's) x 0.001 x --trace-time-scale`` seconds after the first (0.5: twice as fast). vLLM's
``--timed-trace-sec-multiplier M`` gives the seconds per timestamp unit instead (``0.001`` is
real time for a Mooncake trace). ``--num-prompts`` caps the lines replayed, in time order.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from aphrodite_cli.bench.data.datasets import BenchRequest
from aphrodite_cli.bench.data.media_files import read_lines
from aphrodite_cli.bench.load.row_fields import check_span
from engine.errors import ConfigError

#: Mooncake's block size, in tokens
BLOCK_TOKENS = 512
#: The longest prompt a line may ask for (a hostile trace could ask for a billion tokens)
MAX_INPUT_TOKENS = 1 << 20
#: The most hash ids a line may hold
MAX_HASH_IDS = 1 << 16


def _int(value: Any, low: int, high: int) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    return value if ok else None


def _line(row: Any, where: str, block: int) -> tuple[float, int, int, list[int]]:
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is not a JSON object", code="invalid_dataset")
    stamp = row.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(
            stamp) or stamp < 0:
        raise ConfigError(f"{where}: timestamp is a number of milliseconds, at least 0",
                          code="invalid_dataset")
    length = _int(row.get("input_length"), 1, MAX_INPUT_TOKENS)
    output = _int(row.get("output_length"), 1, MAX_INPUT_TOKENS)
    ids = row.get("hash_ids")
    if length is None or output is None:
        raise ConfigError(f"{where}: input_length and output_length are integers from 1 to "
                          f"{MAX_INPUT_TOKENS}", code="invalid_dataset")
    if not isinstance(ids, list) or len(ids) > MAX_HASH_IDS or any(
            _int(h, 0, 2**63 - 1) is None for h in ids):
        raise ConfigError(f"{where}: hash_ids is a list of at most {MAX_HASH_IDS} "
                          "non-negative integers", code="invalid_dataset")
    if len(ids) != math.ceil(length / block):
        raise ConfigError(f"{where}: input_length {length} is {math.ceil(length / block)} "
                          f"blocks of {block} tokens, but hash_ids holds {len(ids)}",
                          hint="--timed-trace-chunk-hash-size sets the block size (Mooncake's "
                               "traces: 512)", code="invalid_dataset")
    return float(stamp), length, output, ids


def load_mooncake(path: Path, prompts: Any, *, block: int = BLOCK_TOKENS,
                  seconds_per_unit: float = 0.001, limit: int, seed: int, nonce: int
                  ) -> list[BenchRequest]:
    """The trace's requests in time order (the first at 0 s), each with its ``arrival_s``,
    its prompt of ``input_length`` tokens built from its blocks, and its ``input_len``."""
    rows = []
    for n, text in enumerate(read_lines(path, "trace"), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except (ValueError, RecursionError):
            raise ConfigError(f"{path}:{n} is not JSON", code="invalid_dataset") from None
        rows.append(_line(row, f"{path}:{n}", block))
    if not rows:
        raise ConfigError(f"the trace {path} has no request", code="invalid_dataset")
    rows.sort(key=lambda r: r[0])
    rows = rows[:limit]
    check_span(path, rows[0][0] * seconds_per_unit, rows[-1][0] * seconds_per_unit)
    blocks: dict[int, list[str]] = {}  # hash id -> its block's words (a token each)

    def words(h: int) -> list[str]:
        if h not in blocks:
            rng = random.Random(f"{seed}:{nonce}:{h}")
            blocks[h] = [rng.choice(prompts.words) for _ in range(block)]
        return blocks[h]

    start = rows[0][0]
    requests = []
    for stamp, length, output, ids in rows:
        last = length - block * (len(ids) - 1)  # the last block's share
        text = "".join("".join(words(h) if k < len(ids) - 1 else words(h)[:last])
                       for k, h in enumerate(ids))
        requests.append(BenchRequest(text, [], output, arrival_s=(stamp - start)
                                     * seconds_per_unit, input_len=length + prompts.overhead))
    return requests
