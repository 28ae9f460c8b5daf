"""The decode attention kernel (engine/models/decode_kernels.py): built with this machine's C
compiler, its results are SDPA's within rounding for every head size, group, mask, stride and
thread count the engine gives it; it never reads a padding column; it is built once and found
again; without a compiler the batched products run and say why."""

from __future__ import annotations

import logging

import pytest

from engine.models import attention, decode_kernels

torch = pytest.importorskip("torch")
sdpa_module = pytest.importorskip("transformers.integrations.sdpa_attention")

#: the kernel sums in its own order (see the module's text): how far from SDPA it may be
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # (the batched products are held to the same)


@pytest.fixture(scope="module")
def kernel():
    lib = decode_kernels.prepare()
    assert lib is not None, "the kernel did not build on this machine (it has a C compiler)"
    return lib


class _Module:
    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups
        self.is_causal = True


def _frame(lengths: list[int], heads: int, kv_heads: int, dim: int, room: int = 0,
           seed: int = 0):
    """Query ``(rows, heads, 1, dim)``; keys and values as the cache holds them: views of
    buffers with ``room`` spare columns, the rows' columns right-aligned to the longest; the
    bool padding mask ``(rows, 1, 1, columns)``."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    q = torch.randn(rows, heads, 1, dim, generator=gen)
    kbuf = torch.randn(rows, kv_heads, width + room, dim, generator=gen)
    vbuf = torch.randn(rows, kv_heads, width + room, dim, generator=gen)
    mask = torch.zeros(rows, 1, 1, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, ..., width - n:] = True
    return q, kbuf[:, :, :width], vbuf[:, :, :width], mask


@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 4, 64), (8, 2, 64), (4, 4, 128),
                                                (16, 2, 32), (6, 2, 24), (14, 2, 16)])
@pytest.mark.parametrize("lengths", [[300, 300, 300], [40, 300, 45, 38], [7]])
def test_its_results_are_sdpas(kernel, heads, kv_heads, dim, lengths):
    """Every head size (multiples of 16 on vectors, others on the plain loop), group (1-8
    query heads per key/value head), row count and padding the engine gives it."""
    q, k, v, mask = _frame(lengths, heads, kv_heads, dim, room=17)
    expected = sdpa_module.sdpa_attention_forward(_Module(heads // kv_heads), q, k, v, mask)[0]
    out = decode_kernels.decode_attention(q, k, v, mask[:, 0, 0, :], dim ** -0.5)
    assert out is not None and out.shape == (len(lengths), 1, heads, dim)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    # through the engine's attention, as the models call it (the scale SDPA's default too)
    torch.testing.assert_close(attention.attention(_Module(heads // kv_heads), q, k, v, mask)[0],
                               expected, **TOLERANCE)
    half = sdpa_module.sdpa_attention_forward(_Module(heads // kv_heads), q, k, v, mask,
                                              scaling=0.5)[0]
    torch.testing.assert_close(attention.attention(_Module(heads // kv_heads), q, k, v, mask,
                                                   scaling=0.5)[0], half, **TOLERANCE)


def test_a_padding_column_is_never_read(kernel):
    """NaN in every padding column's key and value (a read of one would make its row NaN):
    each row's result is that of its own columns alone."""
    lengths = [40, 300, 45, 1]
    q, k, v, mask = _frame(lengths, 12, 4, 64, room=5)
    k[~mask[:, 0, 0, :][:, None, :, None].expand_as(k)] = float("nan")
    v[~mask[:, 0, 0, :][:, None, :, None].expand_as(v)] = float("nan")
    out = decode_kernels.decode_attention(q, k, v, mask[:, 0, 0, :], 0.125)
    assert out is not None and not out.isnan().any()
    for i, n in enumerate(lengths):
        alone = sdpa_module.sdpa_attention_forward(
            _Module(3), q[i:i + 1], k[i:i + 1, :, -n:], v[i:i + 1, :, -n:], None,
            scaling=0.125)[0]
        torch.testing.assert_close(out[i:i + 1], alone, **TOLERANCE)


def test_no_mask_and_threads_give_the_same_result(kernel):
    """No mask: every column. Two threads split the (row, head) pairs, each summed as on one
    thread: the same bits."""
    q, k, v, mask = _frame([200, 200], 12, 4, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_kernels.decode_attention(q, k, v, None, 0.125)
        torch.set_num_threads(2)
        two = decode_kernels.decode_attention(q, k, v, None, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, decode_kernels.decode_attention(q, k, v, mask[:, 0, 0, :],
                                                                    0.125), atol=0, rtol=0)


@pytest.mark.parametrize("dim", [64, 24])
def test_a_rows_result_is_the_same_bits_whatever_its_batch_mates(kernel, dim):
    """A row attended alone (no padding, no mask) and inside frames widened by longer
    batch-mates (its columns left-padded by 1 to 700), at any place among them: the same
    bits; and the kernel's own softmax gives SDPA's result within rounding for large and
    spread scores too."""
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads = 37, 8, 2
    q = torch.randn(1, heads, 1, dim, generator=gen) * 4  # (scores spread wide: exp's range)
    k = torch.randn(1, kv_heads, n, dim, generator=gen)
    v = torch.randn(1, kv_heads, n, dim, generator=gen)
    alone = decode_kernels.decode_attention(q, k, v, None, dim ** -0.5)
    expected = sdpa_module.sdpa_attention_forward(_Module(heads // kv_heads), q, k, v, None)[0]
    torch.testing.assert_close(alone, expected, **TOLERANCE)
    for width, place, mates in ((n + 1, 0, 1), (n + 16, 1, 2), (n + 23, 2, 3), (700, 0, 4)):
        rows = mates + 1
        q_all = torch.randn(rows, heads, 1, dim, generator=gen)
        k_all = torch.randn(rows, kv_heads, width, dim, generator=gen)
        v_all = torch.randn(rows, kv_heads, width, dim, generator=gen)
        keep = torch.ones(rows, width, dtype=torch.bool)
        q_all[place] = q[0]
        k_all[place, :, width - n:] = k[0]
        v_all[place, :, width - n:] = v[0]
        keep[place, :width - n] = False
        out = decode_kernels.decode_attention(q_all, k_all, v_all, keep, dim ** -0.5)
        assert torch.equal(out[place], alone[0]), (width, place)


def test_what_it_does_not_take_goes_to_the_batched_products(kernel, monkeypatch):
    """A float (additive) mask, float64, a group past its limit: None from the kernel, and the
    engine's attention still gives SDPA's result."""
    q, k, v, mask = _frame([290, 300, 280], 12, 4, 16)
    float_mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert decode_kernels.decode_attention(q, k, v, float_mask[:, 0, 0, :], 0.25) is None
    assert decode_kernels.decode_attention(q.double(), k.double(), v.double(),
                                           mask[:, 0, 0, :], 0.25) is None
    wide = torch.randn(3, 4 * (kernel.max_group + 1), 1, 16)
    assert decode_kernels.decode_attention(wide, k, v, mask[:, 0, 0, :], 0.25) is None
    calls: list = []
    real = attention._decode_step
    monkeypatch.setattr(attention, "_decode_step", lambda *a: calls.append(1) or real(*a))
    expected = sdpa_module.sdpa_attention_forward(_Module(3), q, k, v, mask)[0]
    torch.testing.assert_close(attention.attention(_Module(3), q, k, v, float_mask)[0],
                               expected, atol=1e-5, rtol=1e-5)
    assert calls == [1]


def test_it_is_built_once_and_without_a_compiler_the_products_run(kernel, monkeypatch, caplog,
                                                                 tmp_path):
    """A second process finds the built library (no build); with no compiler there is no
    kernel, the reason is logged, and attention is the batched products'."""
    built = list((decode_kernels.paths.cache_root() / "kernels").glob("decode_kernels-*.so"))
    assert built, "the library is not in the cache"
    mtimes = {p: p.stat().st_mtime_ns for p in built}
    monkeypatch.setattr(decode_kernels, "_state", {})
    assert decode_kernels.prepare() is not None
    assert {p: p.stat().st_mtime_ns for p in built} == mtimes  # (found, not built again)

    monkeypatch.setenv("APHRODITE_CACHE_ROOT", str(tmp_path))  # (nothing built there)
    monkeypatch.setattr(decode_kernels, "_state", {})
    monkeypatch.setattr(decode_kernels, "COMPILERS", ("no-such-compiler-here",))
    with caplog.at_level(logging.WARNING, logger=decode_kernels.__name__):
        assert decode_kernels.prepare() is None
    assert "no C compiler found" in caplog.text and "batched products" in caplog.text
    assert decode_kernels.library() is None
    q, k, v, mask = _frame([300, 280], 12, 4, 16)
    expected = sdpa_module.sdpa_attention_forward(_Module(3), q, k, v, mask)[0]
    torch.testing.assert_close(attention.attention(_Module(3), q, k, v, mask)[0], expected,
                               atol=1e-5, rtol=1e-5)
    assert not list(tmp_path.rglob("*.so"))


def test_a_failed_build_leaves_no_file_and_says_why(monkeypatch, tmp_path, caplog):
    """A compiler that fails (a source it cannot compile): no library, no temporary file
    left in the cache, the compiler's message in the log."""
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setenv("APHRODITE_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_kernels, "_state", {})
    monkeypatch.setattr(decode_kernels, "SOURCES", (bad,))
    with caplog.at_level(logging.WARNING, logger=decode_kernels.__name__):
        assert decode_kernels.prepare() is None
    assert "error" in caplog.text
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_turned_off_it_is_not_built(monkeypatch, tmp_path):
    """Both kernels off: nothing built. One off: the library is built for the other, and the
    one turned off is not used."""
    monkeypatch.setenv("APHRODITE_DECODE_ATTENTION_KERNEL", "0")
    monkeypatch.setenv("APHRODITE_DECODE_LINEAR_KERNEL", "0")
    monkeypatch.setenv("APHRODITE_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(decode_kernels, "_state", {})
    assert decode_kernels.prepare() is None and decode_kernels.library() is None
    assert not list(tmp_path.rglob("*.so"))
    monkeypatch.setenv("APHRODITE_DECODE_LINEAR_KERNEL", "1")
    assert decode_kernels.prepare() is not None and decode_kernels.library() is None
    assert decode_kernels.linear(torch.randn(512, 256), None) is not None
    monkeypatch.setenv("APHRODITE_DECODE_LINEAR_KERNEL", "0")
    monkeypatch.setenv("APHRODITE_DECODE_ATTENTION_KERNEL", "1")
    assert decode_kernels.library() is not None
    assert decode_kernels.linear(torch.randn(512, 256), None) is None


def test_a_nan_score_makes_its_row_nan_as_torchs_softmax_does(kernel):
    """A NaN in one kept key: that row's heads over it are NaN (SDPA's result), the other
    rows are untouched; a padding column's NaN (never read) changes nothing."""
    q, k, v, mask = _frame([30, 40], 8, 2, 64)
    k[0, 0, -3] = float("nan")
    out = decode_kernels.decode_attention(q, k, v, mask[:, 0, 0, :], 0.125)
    expected = sdpa_module.sdpa_attention_forward(_Module(4), q, k, v, mask, scaling=0.125)[0]
    assert out[0, :, :4].isnan().all() and not out[0, :, 4:].isnan().any()
    assert expected[0, :, :4].isnan().all()
    torch.testing.assert_close(out[1], expected[1], **TOLERANCE)


def test_shapes_that_do_not_agree_are_not_taken(kernel):
    """Values of another head size than the keys (DeepSeek's MLA outside flash attention),
    keys of another row count, a mask of another width: None (the batched products or SDPA
    run), never a read past a tensor."""
    q, k, v, mask = _frame([20, 20], 8, 2, 32)
    keep = mask[:, 0, 0, :]
    assert decode_kernels.decode_attention(q, k, v[..., :16], keep, 0.1) is None
    assert decode_kernels.decode_attention(q, k[:1], v[:1], keep, 0.1) is None
    assert decode_kernels.decode_attention(q, k, v, keep[:, 1:], 0.1) is None
    assert decode_kernels.decode_attention(q, k, v, keep, 0.1) is not None


def test_its_outputs_are_float32_whatever_torchs_default_dtype(kernel):
    """The buffers the kernels write are float32 even when torch's default dtype is another
    (transformers sets it while it loads a model): the results, not a write past a half-size
    buffer."""
    q, k, v, mask = _frame([20, 25], 8, 2, 32)
    weight = torch.randn(300, 256)
    x = torch.randn(3, 256)
    before = torch.get_default_dtype()
    product = decode_kernels.linear(weight, None)
    expected = decode_kernels.decode_attention(q, k, v, mask[:, 0, 0, :], 0.1)
    try:
        torch.set_default_dtype(torch.float64)
        out = decode_kernels.decode_attention(q, k, v, mask[:, 0, 0, :], 0.1)
        y = product(x)
    finally:
        torch.set_default_dtype(before)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n", [37, 64, 130])
def test_the_small_operations_match_pytorchs(kernel, n):
    """The residual add with the RMS norm, the rotation of q and k, SiLU(gate) * up against
    the same PyTorch operations the model runs, at widths with and without a partial vector
    (the scalar tails); a wrong tensor is refused."""
    from engine.models.lean_decode import _rms
    from engine.models.rotary import rotate

    gen = torch.Generator().manual_seed(n)
    rows = 3
    h, delta = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen)
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.randn(n, generator=gen), 1e-6
    expected_h = h + delta
    x = torch.empty_like(h)
    decode_kernels.add_rms(kernel, h, delta, norm.weight, 1e-6, x)
    assert torch.equal(h, expected_h)
    torch.testing.assert_close(x, _rms(norm, expected_h), atol=1e-6, rtol=1e-5)

    heads, kv_heads, dim = 4, 2, 16 if n < 100 else 32
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim + 5, generator=gen)[:, 5:]
    cos, sin = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    q, k = decode_kernels.rotate_qk(kernel, qkv, cos, sin, heads, kv_heads, dim)
    want_q = rotate(qkv[:, :heads * dim].reshape(rows, heads, 1, dim), cos[:, None, None],
                    sin[:, None, None])
    want_k = rotate(qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(rows, kv_heads, 1, dim),
                    cos[:, None, None], sin[:, None, None])
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)

    gate_up = torch.randn(rows, 2 * n, generator=gen) * 8
    act = decode_kernels.silu_mul(kernel, gate_up)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:],
                               atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="add_rms"):
        decode_kernels.add_rms(kernel, h, delta[:, :-1], norm.weight, 1e-6, x)
    with pytest.raises(ValueError, match="silu_mul"):
        decode_kernels.silu_mul(kernel, gate_up.double())


def test_a_library_others_may_write_is_not_loaded(monkeypatch, tmp_path, caplog):
    """A kernels folder others may write (a shared cache root): the library is not loaded,
    the log says why and names the setting; a private one loads."""
    shared = tmp_path / "shared"
    monkeypatch.setenv("APHRODITE_CACHE_ROOT", str(shared))
    monkeypatch.setattr(decode_kernels, "_state", {})
    assert decode_kernels.prepare() is not None
    (shared / "kernels").chmod(0o777)
    monkeypatch.setattr(decode_kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger=decode_kernels.__name__):
        assert decode_kernels.prepare() is None
    assert "APHRODITE_CACHE_ROOT" in caplog.text


def test_a_compiler_without_openmp_still_builds_them(monkeypatch, tmp_path, caplog):
    """A compiler that refuses -fopenmp (Apple's clang): built again without it, loaded,
    logged, older builds beside it removed; the results are the same."""
    import shutil

    real = shutil.which("cc") or shutil.which("gcc")
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && '
                    f'{{ echo "unsupported option -fopenmp" >&2; exit 1; }}; done\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(decode_kernels, "COMPILERS", ("cc",))
    monkeypatch.setenv("APHRODITE_CACHE_ROOT", str(tmp_path / "cache"))
    stale = tmp_path / "cache" / "kernels" / "decode_attention-0123456789abcdef.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older build")
    monkeypatch.setattr(decode_kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger=decode_kernels.__name__):
        assert decode_kernels.prepare() is not None
    assert "without OpenMP" in caplog.text
    assert not stale.exists()  # (an older build beside it is removed)
    q, k, v, mask = _frame([30, 40], 8, 2, 64)
    expected = sdpa_module.sdpa_attention_forward(_Module(4), q, k, v, mask, scaling=0.125)[0]
    torch.testing.assert_close(decode_kernels.decode_attention(q, k, v, mask[:, 0, 0, :], 0.125),
                               expected, **TOLERANCE)


def _register_floats() -> int:
    """The widest float vector register this CPU has, from its flags (4 where it names none
    of AVX-512F and AVX: NEON, SSE)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return 16 if "avx512f" in flags else 8 if "avx" in flags else 4


def test_its_vectors_are_the_cpus_own_registers(kernel):
    # vectors wider than the registers are lowered through the stack: on an AVX2-only Zen 3
    # the 16-float kernels ran a decode step of 8 rows 10x slower (130 vs 12.5 ms)
    assert kernel.vector_floats == _register_floats()
