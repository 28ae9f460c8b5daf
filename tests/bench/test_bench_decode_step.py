"""``bench decode-step``: on the tiny Qwen2.5-VL the command runs the engine's lean decode
step per batch size and context length and writes a result whose bytes are the language
model's weights (counted here from its config, not from the loaded model) plus the rows' keys
and values, and whose ratio is the median step over those bytes at the measured bandwidth;
bad flags are refused before any model loads."""

from __future__ import annotations

import json

import pytest

from aphrodite_cli.bench.offline.decode_step import llc_bytes
from aphrodite_cli.bench.results.files import load_result
from aphrodite_cli.bench.results.report import summary_markdown
from engine.models.loader import tiny_model_dir
from tests.server.test_cli import run


def _expected_bytes(text: dict, rows: int, context: int) -> tuple[int, int]:
    """Float32 weights a decode step reads and the keys and values of ``context + 1``
    columns, from a Qwen2 text config: q/k/v products with biases, o and the three MLP
    products without, two norms per layer, the final norm, the embedding table (tied: it is
    the head, read whole)."""
    hidden, mlp, layers = text["hidden_size"], text["intermediate_size"], \
        text["num_hidden_layers"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    dim = text.get("head_dim") or hidden // heads
    assert text["tie_word_embeddings"]
    per_layer = (hidden * heads * dim + heads * dim  # q
                 + 2 * (hidden * kv_heads * dim + kv_heads * dim)  # k, v
                 + heads * dim * hidden  # o
                 + 3 * hidden * mlp  # gate, up, down
                 + 2 * hidden)  # the two norms
    weights = 4 * (layers * per_layer + hidden + text["vocab_size"] * hidden)
    kv = 4 * layers * 2 * rows * kv_heads * (context + 1) * dim
    return weights, kv


def test_the_decode_step_is_timed_beside_its_bytes_and_the_bandwidth_floor(tmp_path):
    result = run("bench", "decode-step", "--batch-sizes", "1,3", "--context-lens", "24,40",
                 "--warmups", "1", "--repeats", "4", "--num-threads", "1", "--read-mib", "16",
                 "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "x floor" in result.stdout
    [path] = tmp_path.glob("decode-step-*.json")
    doc = load_result(path, ("decode-step",))
    assert doc["decode_path"] == "lean" and doc["num_threads"] == 1
    assert doc["decode_attention"] == "kernel"  # (this machine has a C compiler)
    assert doc["decode_linear_kernel_products"] == 0  # (the tiny model's are all too small)
    assert doc["decode_layers_in_one_call"] is False  # (so the layers are not in one call)
    assert doc["bandwidth"]["read_bytes"] == 16 << 20
    bandwidth = doc["bandwidth"]["gb_s"]
    # 3 before, and for each of the 4 configurations one after each of its 4 timed steps and
    # 3 after it
    assert bandwidth["count"] == 3 + 4 * (4 + 3) and bandwidth["median"] > 0
    text = json.loads((tiny_model_dir() / "config.json").read_text())["text_config"]
    assert [(r["batch_size"], r["context_len"]) for r in doc["rows"]] == \
        [(1, 24), (3, 24), (1, 40), (3, 40)]
    for row in doc["rows"]:
        weights, kv = _expected_bytes(text, row["batch_size"], row["context_len"])
        assert (row["weight_bytes"], row["kv_bytes"]) == (weights, kv)
        assert row["bytes"] == weights + kv
        assert row["step_ms"]["count"] == 4
        beside = row["bandwidth_gb_s"]  # (read beside its own steps: its floor's)
        assert beside["count"] == 4 and bandwidth["min"] <= beside["median"] <= bandwidth["max"]
        floor_ms = row["bytes"] / (beside["median"] * 1e9) * 1e3
        assert row["floor_ms"] == pytest.approx(floor_ms)
        assert row["ratio_to_floor"] == pytest.approx(row["step_ms"]["median"] / floor_ms)
        assert row["achieved_gb_s"] == pytest.approx(
            row["bytes"] / row["step_ms"]["median"] / 1e6)
    report = summary_markdown([(path, doc)])
    last = doc["rows"][-1]
    assert f"| 3 | 40 | {last['step_ms']['median']:.2f} |" in report
    assert f"| {last['ratio_to_floor']:.2f} |" in report


def _int8_weight_bytes(text: dict) -> int:
    """What a decode step reads of the tiny model quantized: each layer's seven products as
    int8 rows (a byte per weight) with a float32 scale per row; biases, norms and the tied
    embedding table float32 as loaded."""
    hidden, mlp, layers = text["hidden_size"], text["intermediate_size"], \
        text["num_hidden_layers"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    dim = text.get("head_dim") or hidden // heads
    outs = [(heads * dim, hidden), (kv_heads * dim, hidden), (kv_heads * dim, hidden),
            (hidden, heads * dim), (mlp, hidden), (mlp, hidden), (hidden, mlp)]
    per_layer = sum(o * i + 4 * o for o, i in outs)  # rows + scales
    per_layer += 4 * (heads * dim + 2 * kv_heads * dim) + 4 * 2 * hidden  # biases, norms
    return layers * per_layer + 4 * (hidden + text["vocab_size"] * hidden)


def test_int8_is_timed_beside_the_weights_as_loaded_with_its_quality_cost(tmp_path):
    result = run("bench", "decode-step", "--batch-sizes", "2", "--context-lens", "24",
                 "--warmups", "1", "--repeats", "2", "--num-threads", "1", "--read-mib", "16",
                 "--quantization", "int8", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "top-1 agreement" in result.stdout and "vs f32" in result.stdout
    [path] = tmp_path.glob("decode-step-*.json")
    doc = load_result(path, ("decode-step",))
    text = json.loads((tiny_model_dir() / "config.json").read_text())["text_config"]
    plain, int8 = doc["rows"]
    assert (plain["quantization"], int8["quantization"]) == ("none", "int8")
    assert plain["weight_bytes"] == _expected_bytes(text, 2, 24)[0]
    assert int8["weight_bytes"] == _int8_weight_bytes(text)
    assert int8["kv_bytes"] == plain["kv_bytes"]  # the cache stays float32
    # (the tiny model's weights are under the linear kernel's minimum, int8 or not)
    assert doc["decode_linear_kernel_products_by_quantization"] == {"none": 0, "int8": 0}
    assert int8["vs_unquantized"] == pytest.approx(
        int8["step_ms"]["median"] / plain["step_ms"]["median"])
    quality = doc["quality"]["int8"]
    assert (quality["prompts"], quality["tokens_per_prompt"]) == (8, 32)
    assert quality["positions"] == 8 * 32
    for share in ("top1_agreement", "greedy_match"):
        assert 0 <= quality[share] <= 1
    assert 0 <= quality["identical_prompts"] <= 8
    assert 0 <= quality["mean_kl"] < 0.01  # (int8 rows of a random model: close)
    assert "int8: top-1 agreement" in summary_markdown([(path, doc)])


@pytest.mark.parametrize(("args", "named"), [
    (["--model", "tiny:qwen2_5_vl", "--size", "small"], "not both"),
    (["--batch-sizes", "1,x"], "comma-separated list of positive integers"),
    (["--batch-sizes", "0"], "comma-separated list of positive integers"),
    (["--context-lens", "12", "--warmups", "3", "--repeats", "20"], "must exceed"),
    (["--quantization", "int4"], "use one of int8"),
])
def test_bad_flags_are_refused_before_a_model_loads(tmp_path, args, named):
    result = run("bench", "decode-step", *args, "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in " ".join(result.stderr.split())
    assert not list(tmp_path.iterdir())


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for name, level, size in (("index0", 1, "48K"), ("index2", 2, "2048K"),
                              ("index3", 3, "480M"), ("index4", "x", "1G")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(f"{level}\n")
        (tmp_path / name / "size").write_text(f"{size}\n")
    assert llc_bytes(tmp_path) == 480 << 20
    assert llc_bytes(tmp_path / "absent") is None


def test_an_untied_embedding_table_counts_only_the_rows_a_step_reads():
    import torch

    from aphrodite_cli.bench.offline.decode_step import weight_bytes

    class Text(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(1000, 16)
            self.layer = torch.nn.Linear(16, 32)

        def get_input_embeddings(self):
            return self.embed_tokens

    class Model(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.language_model = Text()
            self.lm_head = torch.nn.Linear(16, 1000, bias=False)
            if tied:
                self.lm_head.weight = self.language_model.embed_tokens.weight

        def get_output_embeddings(self):
            return self.lm_head

    layer = 4 * (16 * 32 + 32)
    assert weight_bytes(Model(tied=False), rows=3) == layer + 4 * 1000 * 16 + 4 * 3 * 16
    assert weight_bytes(Model(tied=True), rows=3) == layer + 4 * 1000 * 16


def test_the_quality_comparison_is_perfect_against_itself_and_kl_is_float_first():
    """A model compared with itself agrees everywhere with KL 0; against a uniform reference
    distribution the KL is KL(uniform || model) = -log V - mean(log q), per position."""
    import math

    import torch

    from aphrodite_cli.bench.offline import quant_quality
    from tests.engine_fixtures import llm

    model = llm("qwen2_5_vl")
    ref = quant_quality.reference(model, 4)
    same = quant_quality.compare(model, ref)
    assert (same["top1_agreement"], same["greedy_match"], same["identical_prompts"]) == \
        (1.0, 1.0, len(quant_quality.PROMPTS))
    assert same["mean_kl"] == pytest.approx(0, abs=1e-9)
    own = quant_quality._log_probs(model, ref["continuations"])
    vocab = own[0].shape[-1]
    uniform = {**ref, "log_probs": [torch.full_like(p, -math.log(vocab)) for p in own]}
    want = float(torch.cat([-math.log(vocab) - p.mean(-1) for p in own]).mean())
    assert quant_quality.compare(model, uniform)["mean_kl"] == pytest.approx(want, rel=1e-4)


def test_compile_decode_times_the_eager_and_the_compiled_step_in_turn(tmp_path):
    """``--compile-decode``: the compiles are awaited, each configuration timed on both steps
    (a step of each in turn), the compiled row's ratio to the eager one given, and no graph
    compiled while the steps were timed."""
    result = run("bench", "decode-step", "--batch-sizes", "1", "--context-lens", "24",
                 "--warmups", "1", "--repeats", "4", "--num-threads", "1", "--read-mib", "16",
                 "--compile-decode", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled buckets [1]" in result.stdout
    [path] = tmp_path.glob("decode-step-*.json")
    doc = load_result(path, ("decode-step",))
    assert doc["decode_path"] == "lean-compiled"
    assert doc["compile"]["buckets"] == [1] and doc["compile"]["error"] is None
    assert doc["compile"]["graphs_compiled_in_steps"] == 0
    eager, compiled = doc["rows"]
    assert (eager["compiled"], compiled["compiled"]) == (False, True)
    assert eager["step_ms"]["count"] == compiled["step_ms"]["count"] == 4
    assert eager["bytes"] == compiled["bytes"]
    assert compiled["vs_eager"] == pytest.approx(
        compiled["step_ms"]["median"] / eager["step_ms"]["median"])
    assert "| compiled | 1 | 24 |" in summary_markdown([(path, doc)])


def test_compile_decode_beside_quantization_is_refused(tmp_path):
    result = run("bench", "decode-step", "--compile-decode", "--quantization", "int8",
                 "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "leave out --quantization" in " ".join(result.stderr.split())
    assert not list(tmp_path.iterdir())


def test_compile_decode_on_a_model_without_the_lean_step_is_a_one_line_error(tmp_path):
    result = run("bench", "decode-step", "--model", "tiny:gemma3", "--compile-decode",
                 "--batch-sizes", "1", "--context-lens", "24", "--warmups", "1", "--repeats",
                 "2", "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--compile-decode: this model's decode step is not compiled (the model's own " \
        "forward runs it)" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())
