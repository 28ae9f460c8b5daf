"""Prefix caching and the encoder output cache.

Pure parts first (block hashes chained and keyed by media content, the LRU under a byte bound,
how much of a found prefix a prefill may take), then the engine on every family: a second
prompt that shares a prefix (the same image, the same text start, another question) takes it
from the cache, reports its cached tokens, does not run the encoder, and its logits are those
the model's own ``generate`` gives it alone; another image of the same size never shares the
media's blocks; a small bound evicts."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.executor import runner as runner_module
from engine.executor.encoder_cache import EncoderCache, nbytes
from engine.executor.engine import Engine
from engine.executor.prefix_cache import PrefixCache, block_hashes, usable_prefix
from engine.executor.request import EngineRequest
from tests.engine.test_scheduler import (
    after_tokens,
    assert_generate_logits,
    greedy,
    media_item,
    record_logits,
)
from tests.engine_fixtures import FAMILIES, llm

# -- pure ---------------------------------------------------------------------------------


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    ids = list(range(40))
    hashes = block_hashes(ids, 16)
    assert len(hashes) == 2  # the last 8 tokens are no full block
    changed = block_hashes([99, *ids[1:]], 16)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # the parent changes the child
    later = block_hashes(ids[:16] + [7] * 24, 16)
    assert later[0] == hashes[0] and later[1] != hashes[1]
    assert block_hashes(ids, 16) == hashes  # by identity only: the same tokens, the same hash


def test_media_keys_go_into_the_blocks_their_tokens_touch():
    ids = [1] * 64  # the same placeholder tokens for two different images
    one = block_hashes(ids, 16, ["image-a"], [(20, 8)])
    two = block_hashes(ids, 16, ["image-b"], [(20, 8)])
    assert one[0] == two[0]  # before the item: shared
    assert one[1] != two[1] and one[2] != two[2] and one[3] != two[3]  # from it on: never
    plain = block_hashes(ids, 16)
    assert one[0] == plain[0] and one[1] != plain[1]
    with pytest.raises(ValueError):
        block_hashes(ids, 16, ["a"], [])


def test_the_lru_keeps_a_prefix_under_its_byte_bound_and_evicts_deepest_blocks_first():
    cache = PrefixCache(max_bytes=100, block_size=4)
    a = cache.hashes(list(range(12)))  # three blocks
    cache.put(a, {i: (f"a{i}", 30) for i in range(3)})
    assert cache.longest(a) == 3 and cache.stats.bytes == 90
    b = cache.hashes([0, 1, 2, 3, 9, 9, 9, 9])  # shares a's first block
    assert cache.longest(b) == 1 and cache.missing(b) == [1]
    cache.put(b, {1: ("b1", 30)})
    # over the bound: a's deepest block went first, its shared first block stayed
    assert cache.stats.bytes == 90 and cache.stats.evictions == 1
    assert cache.longest(a) == 2 and cache.longest(b) == 2
    assert cache.get(a[:2]) == ["a0", "a1"]
    cache.put(cache.hashes([5] * 4), {0: ("c", 30)})  # evicts b's block, the least recent
    assert cache.longest(b) == 1 and cache.longest(a) == 2
    cache.put(cache.hashes([6] * 4), {0: ("huge", 101)})  # larger than the bound: not kept
    assert cache.stats.bytes <= 100 and cache.longest(cache.hashes([6] * 4)) == 0


def test_a_prefill_takes_whole_blocks_never_the_last_token_nor_part_of_the_media():
    assert usable_prefix(48, 48, None, 16) == 32  # the last token's logits are recomputed
    assert usable_prefix(48, 49, None, 16) == 48
    assert usable_prefix(48, 100, (20, 40), 16) == 48  # the whole media span is cached
    assert usable_prefix(32, 100, (20, 40), 16) == 16  # half the span: back before it
    assert usable_prefix(16, 100, (16, 40), 16) == 16  # ends right before it
    assert usable_prefix(0, 100, None, 16) == 0
    # a model that resumes from its merged embeddings keeps the blocks inside the span
    assert usable_prefix(32, 100, (20, 40), 16, inside_media=True) == 32
    assert usable_prefix(48, 48, (20, 40), 16, inside_media=True) == 32


def test_the_encoder_cache_returns_a_pass_seen_before_without_running_it():
    import torch

    runs = []

    class Encoder(torch.nn.Module):
        def forward(self, x):
            runs.append(1)
            return {"features": x * 2}

    encoder = Encoder()
    cache = EncoderCache(max_bytes=64)
    cache.install(encoder)
    x = torch.ones(4)
    with cache.keyed(("img-a",)):
        first = encoder(x)
    with cache.keyed(("img-a",)):
        again = encoder(x)
    assert len(runs) == 1 and torch.equal(first["features"], again["features"])
    assert again is not first  # a fresh container each time
    with cache.keyed(("img-b",)):
        encoder(x)
    encoder(x)  # unnamed: never cached
    assert len(runs) == 3 and (cache.stats.hits, cache.stats.misses) == (1, 2)
    with cache.keyed(("img-c",)):
        encoder(torch.ones(12))  # 48 more bytes: the oldest entry (img-a's) goes
    assert cache.stats.bytes == 64 and cache.stats.evictions == 1
    with cache.keyed(("img-a",)):
        encoder(x)
    assert len(runs) == 5
    assert nbytes((x, [x], {"a": x})) == 48


# -- the engine on every family -----------------------------------------------------------

SYSTEM = "You are a careful assistant who looks at everything you are shown. " * 2
COMMON = "Look closely at it and at every detail of it before you answer anything. " * 2


def shared_prompts(arch: str) -> list:
    """Two questions about one item after a shared start, and the second about another item
    of the same size (the same placeholder tokens)."""
    model = llm(arch)
    spec = model.loaded.spec
    modality = spec.modalities[0]
    placeholder = spec.placeholders[modality]
    return [model.prepare(SYSTEM + placeholder + COMMON + question, [media_item(modality, seed)],
                          None, False)[1]
            for seed, question in ((1, "What is it?"), (1, "Which colours are there?"),
                                   (2, "Which colours are there?"))]


def media_span(engine: Engine, prompt) -> tuple[int, int]:
    at = [i for i, t in enumerate(prompt.input_ids) if t in engine.runner.media_token_ids]
    return at[0], at[-1]


def run(engine: Engine, prompt, tokens: int = 4) -> EngineRequest:
    req = engine.submit(EngineRequest(prompt, greedy(tokens)))
    assert req.done.wait(120) and req.error is None, req.error
    return req


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_shared_prefix_is_reused_with_the_logits_of_the_models_own_generate(arch):
    model = llm(arch)
    first, second, other = shared_prompts(arch)
    engine = Engine(model.loaded)
    logits = record_logits(engine)
    try:
        if engine.runner.prefix_cache is None:
            # sliding-window layers keep only a prompt's last columns: no prefix to cut
            assert arch == "gemma3"
            return
        reqs = [run(engine, p) for p in (first, second, other)]
        span = media_span(engine, second)
        assert reqs[0].num_cached_tokens == 0
        # the image and the text before the question came from the cache: no encoder ran
        assert reqs[1].num_cached_tokens > span[1]
        assert reqs[1].timings["encoder_s"] == 0.0
        # another image: only the text before it is shared
        assert 0 < reqs[2].num_cached_tokens <= span[0]
        assert reqs[2].timings["encoder_s"] > 0.0
        for req, prompt in zip(reqs, (first, second, other), strict=True):
            assert_generate_logits(engine, logits, req, prompt, 4)
        stats = engine.scheduler_stats()
        assert stats["prefix_cache_hits"] == reqs[1].num_cached_tokens + \
            reqs[2].num_cached_tokens
        assert stats["prefix_cache_queries"] == sum(len(p.input_ids)
                                                    for p in (first, second, other))
    finally:
        engine.close()


def short_tail_prompts(arch: str, block_size: int = 16) -> list:
    """Two short questions right after one item, the text before it lengthened until the
    blocks the second shares with the first end inside the item's tokens (less than a block
    of text follows them)."""
    model = llm(arch)
    spec = model.loaded.spec
    modality = spec.modalities[0]
    media = set(model.loaded.tokenizer.convert_tokens_to_ids(
        [spec.feature_token(m) for m in spec.modalities]))
    for extra in range(block_size):
        prompts = [model.prepare(SYSTEM + " ok" * extra + spec.placeholders[modality] + question,
                                 [media_item(modality, 4)], None, False)[1]
                   for question in ("What?", "Which colours?")]
        ids = [p.input_ids for p in prompts]
        shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
        at = [i for i, t in enumerate(ids[1]) if t in media]
        if at[0] < shared // block_size * block_size <= at[-1]:
            return prompts
    raise AssertionError(f"{arch}: no text length puts a block boundary inside the item")


@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_cached_prefix_that_ends_inside_the_media_resumes_there(arch, chunked):
    """vLLM reuses the part of an item a cached prefix holds: so does a family that hands its
    language model merged embeddings (the prefill resumes inside the media span from them,
    with the encoder output cached); the logits are the model's own ``generate``'s. Families
    whose media also enter deeper layers (Qwen3-VL) cut the prefix back before the media."""
    model = llm(arch)
    first, second = short_tail_prompts(arch)
    budget = {"max_num_batched_tokens": 4} if chunked else {}
    engine = Engine(model.loaded, EngineConfig(**budget))
    logits = record_logits(engine)
    plans = []
    start = engine.runner.start_chunked
    engine.runner.start_chunked = lambda row: plans.append(start(row)) or plans[-1]
    try:
        if engine.runner.prefix_cache is None:
            assert arch == "gemma3"  # sliding-window layers: no prefix cache
            return
        span = media_span(engine, second)
        reqs = [run(engine, p) for p in (first, second)]
        cached = reqs[1].num_cached_tokens
        if model.loaded.spec.resume_in_media:
            assert engine.runner.resumes_in_media
            assert span[0] < cached <= span[1], (span, cached)  # inside the item's tokens
            # the item's encoder output came from the encoder cache: its layers did not run
            stats = engine.runner.encoder_cache.stats
            assert (stats.hits, stats.misses) == (1, 1)
            # chunked: the second prompt's chunks are fed from its merged embeddings
            assert [p.embeds is not None for p in plans] == ([False, True] if chunked else [])
        else:
            assert arch == "qwen3_vl"
            assert cached <= span[0]
        for req, prompt in zip(reqs, (first, second), strict=True):
            assert_generate_logits(engine, logits, req, prompt, 4)
    finally:
        engine.close()


def test_the_embeddings_capture_stops_only_its_own_threads_forward():
    """The capture's hook stays on the language model; a decode step of the same model on
    another thread (the engine thread beside an overlapped prefill) runs through it."""
    import threading

    import torch

    from engine.executor import media_embeds

    engine = Engine(llm("qwen2_5_vl").loaded)
    try:
        runner = engine.runner
        ids = torch.tensor([[1, 2, 3]])
        runner._merged_embeds._local.active = True  # this thread is inside a capture
        shapes = []
        other = threading.Thread(target=lambda: shapes.append(
            runner.model(input_ids=ids, use_cache=False).logits.shape))
        other.start()
        other.join(60)
        assert shapes and tuple(shapes[0][:2]) == (1, 3)
        with pytest.raises(media_embeds._Captured):
            runner.model(input_ids=ids, use_cache=False)
    finally:
        runner._merged_embeds._local.active = False
        engine.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_same_media_after_another_start_skips_the_encoder(arch):
    """The prefix misses before the item (another system text), but the encoder's output for
    that item is cached: the encoder's layers do not run and the logits are unchanged."""

    model = llm(arch)
    spec = model.loaded.spec
    modality = spec.modalities[0]
    prompts = [model.prepare(start + spec.placeholders[modality] + "What is it?",
                             [media_item(modality, 3)], None, False)[1]
               for start in ("First start. ", "A different start of the prompt. ")]
    engine = Engine(model.loaded, EngineConfig(enable_prefix_caching=False))
    runner = engine.runner
    encoder = getattr(runner.model, spec.encoder_attr, None) or getattr(
        runner.model.model, spec.encoder_attr)
    layers_ran = []
    hook = next(encoder.children()).register_forward_hook(lambda *_: layers_ran.append(1))
    logits = record_logits(engine)
    try:
        reqs = [run(engine, p) for p in prompts]
        assert len(layers_ran) == 1  # the first request's; the second took the output
        assert (runner.encoder_cache.stats.hits, runner.encoder_cache.stats.misses) == (1, 1)
        assert reqs[1].num_cached_tokens == 0
        for req, prompt in zip(reqs, prompts, strict=True):
            assert_generate_logits(engine, logits, req, prompt, 4)
    finally:
        hook.remove()
        engine.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_rows_with_different_cached_prefixes_are_prefilled_in_one_pass(arch, monkeypatch):
    """Three waiting rows: one whose cached prefix covers its item, one whose prefix ends
    before its item (the encoder runs for it alone), one with no prefix at all. They are
    prefilled together in one forward pass (not one at a time: concurrent cold requests
    sharing only a chat template's first block must not lose their batched encoder and
    prefill), and each gets the logits of the model's own ``generate``. (Rows of very
    different lengths go in separate passes by default, ``length_groups``: here all rows
    are put in one, the case that has padding both in the cached and the new columns.)"""
    monkeypatch.setattr(runner_module, "length_groups", lambda lengths, **_: [list(range(len(
        lengths)))])

    model = llm(arch)
    first, second, other = shared_prompts(arch)
    spec = model.loaded.spec
    modality = spec.modalities[0]
    fresh = model.prepare("An unrelated start of a prompt. " + spec.placeholders[modality]
                          + "Describe it.", [media_item(modality, 5)], None, False)[1]
    engine = Engine(model.loaded, EngineConfig(encoder_cache_gb=0), batch_wait_s=1.0)
    logits = record_logits(engine)
    try:
        if engine.runner.prefix_cache is None:
            assert arch == "gemma3"
            return
        run(engine, first)
        passes = []  # the model's forward passes over more than one token per row
        hook = engine.runner.model.register_forward_pre_hook(
            lambda _m, _a, kw: passes.append(kw["input_ids"].shape) if kw[
                "input_ids"].shape[1] > 1 else None, with_kwargs=True)
        reqs = [engine.submit(EngineRequest(p, greedy(4))) for p in (second, other, fresh)]
        for req in reqs:
            assert req.done.wait(120) and req.error is None, req.error
        hook.remove()
        assert len(passes) == 1 and passes[0][0] == 3, passes  # one prefill for all three
        assert [r.timings["batch_size"] for r in reqs] == [3, 3, 3]
        span = media_span(engine, second)
        assert reqs[0].num_cached_tokens > span[1]
        assert 0 < reqs[1].num_cached_tokens <= span[0]
        assert reqs[2].num_cached_tokens == 0
        for req, prompt in zip(reqs, (second, other, fresh), strict=True):
            assert_generate_logits(engine, logits, req, prompt, 4)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_pass_with_a_row_resumed_inside_its_media_feeds_every_row_embeddings(arch,
                                                                              monkeypatch):
    """One pass of a row resumed inside its item, a row whose item is cached whole and a cold
    row: the pass is fed embeddings (the resumed row's merged, the cached row's from the
    embedding table, the cold row's merged with its own item), and each row gets the logits
    of the model's own ``generate``."""
    monkeypatch.setattr(runner_module, "length_groups", lambda lengths, **_: [list(range(len(
        lengths)))])
    model = llm(arch)
    if not model.loaded.spec.resume_in_media:
        pytest.skip(f"{arch} cuts a prefix back before its media")
    first, second, _ = shared_prompts(arch)
    short_first, short_second = short_tail_prompts(arch)
    spec = model.loaded.spec
    fresh = model.prepare("An unrelated start of a prompt. " + spec.placeholders[
        spec.modalities[0]] + "Describe it.", [media_item(spec.modalities[0], 5)], None,
        False)[1]
    engine = Engine(model.loaded, batch_wait_s=1.0)
    logits = record_logits(engine)
    try:
        for prompt in (first, short_first):
            run(engine, prompt)
        passes = []
        hook = engine.runner.model.register_forward_pre_hook(
            lambda _m, _a, kw: passes.append(sorted(k for k in ("input_ids", "inputs_embeds")
                                                    if kw.get(k) is not None)) if kw.get(
                "past_key_values", kw.get("cache")) is not None and kw.get(
                "use_cache") else None, with_kwargs=True)
        reqs = [engine.submit(EngineRequest(p, greedy(4))) for p in (second, short_second,
                                                                      fresh)]
        for req in reqs:
            assert req.done.wait(120) and req.error is None, req.error
        hook.remove()
        assert passes[0] == ["inputs_embeds"], passes  # the prefill, fed embeddings
        assert [r.timings["batch_size"] for r in reqs] == [3, 3, 3]
        assert reqs[0].num_cached_tokens > media_span(engine, second)[1]
        span = media_span(engine, short_second)
        assert span[0] < reqs[1].num_cached_tokens <= span[1]
        for req, prompt in zip(reqs, (second, short_second, fresh), strict=True):
            assert_generate_logits(engine, logits, req, prompt, 4)
    finally:
        engine.close()


def test_rows_are_grouped_into_passes_that_waste_little_on_padding():
    groups = runner_module.length_groups
    assert groups([240, 790, 250, 800, 245]) == [[0, 4, 2], [1, 3]]
    assert groups([100] * 4) == [[0, 1, 2, 3]]
    assert groups([10, 1000]) == [[0], [1]]
    assert groups([]) == []
    # no pass computes more than the slack's share of its tokens as padding
    lengths = [17, 300, 31, 290, 1200, 44, 280, 1100, 5]
    for group in groups(lengths):
        own = sum(lengths[i] for i in group)
        assert len(group) * max(lengths[i] for i in group) <= 1.15 * own
    assert sorted(i for g in groups(lengths) for i in g) == list(range(len(lengths)))


def test_a_pass_holds_at_most_the_pass_token_bound_and_cpus_bound_it_by_default():
    groups = runner_module.length_groups
    assert groups([100] * 4, max_tokens=256) == [[0, 1], [2, 3]]
    assert groups([240, 250, 245], max_tokens=256) == [[0], [2], [1]]  # shortest first
    assert groups([300, 20, 19], max_tokens=256) == [[2, 1], [0]]  # one over it: alone
    lengths = [17, 30, 31, 29, 120, 44, 28, 110, 5]
    for bound in (32, 64, 100, 256):
        got = groups(lengths, max_tokens=bound)
        assert sorted(i for g in got for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= bound for g in got)
    assert EngineConfig().pass_tokens == 256
    assert EngineConfig(device="cuda").pass_tokens is None
    assert EngineConfig(prefill_pass_tokens=4096).pass_tokens == 4096
    with pytest.raises(ConfigError, match="--prefill-pass-tokens"):
        EngineConfig(prefill_pass_tokens=0)


def test_a_row_prefilled_beside_others_is_reused_from_its_own_columns():
    """Rows of different lengths prefilled together are left-padded: the prefix stored for
    the shorter one is its own columns, and a request reusing it while the first ones still
    run gets the logits of the model's own generate."""

    model = llm("qwen2_5_vl")
    first, second, _ = shared_prompts("qwen2_5_vl")
    longer = model.prepare("Some other long text that is not shared at all. " * 8, [], None,
                           True)[1]
    engine = Engine(model.loaded, EngineConfig(), batch_wait_s=1.0)
    logits = record_logits(engine)
    try:
        on_event, started = after_tokens(1)
        running = [engine.submit(EngineRequest(longer, greedy(30))),
                   engine.submit(EngineRequest(first, greedy(30), on_event=on_event))]
        assert started.wait(120)
        reuse = run(engine, second)
        for r in running:
            assert r.done.wait(120) and r.error is None
        assert running[1].timings["batch_size"] == 2  # prefilled together
        assert reuse.num_cached_tokens > media_span(engine, second)[1]
        assert reuse.timings["batch_size"] >= 2  # joined the running batch
        assert_generate_logits(engine, logits, reuse, second, 4)
    finally:
        engine.close()


def test_a_cached_prefix_and_chunked_prefill_and_a_small_bound_that_evicts():
    model = llm("qwen2_vl")
    first, second, other = shared_prompts("qwen2_vl")
    engine = Engine(model.loaded, EngineConfig(max_num_batched_tokens=32, encoder_cache_gb=0))
    logits = record_logits(engine)
    try:
        run(engine, first)
        reuse = run(engine, second)  # over the budget: chunks after the cached prefix
        assert reuse.num_cached_tokens > media_span(engine, second)[1]
        assert_generate_logits(engine, logits, reuse, second, 4)
    finally:
        engine.close()
    block = engine.runner.prefix_cache.stats.bytes // engine.runner.prefix_cache.stats.blocks
    small = Engine(model.loaded, EngineConfig(prefix_cache_gb=3 * block / (1 << 30)))
    try:
        reqs = [run(small, p) for p in (first, other, second)]
        stats = small.runner.prefix_cache.stats
        assert stats.bytes <= 3 * block and stats.evictions > 0
        # a prompt's deepest blocks go first: the three leading blocks, which every prompt
        # here shares, are all that stays
        assert [r.num_cached_tokens for r in reqs] == [0, 48, 48]
    finally:
        small.close()


def test_the_token_budget_is_charged_only_the_uncached_prompt_tokens():
    """A prompt longer than --max-num-batched-tokens whose cached prefix leaves fewer tokens
    than the budget joins in one prefill, not in chunks; the step counters count the tokens
    actually prefilled; its logits are the model's own."""

    model = llm("qwen2_5_vl")
    first, second, _ = shared_prompts("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig())
    logits = record_logits(engine)
    try:
        run(engine, first)
        cached = engine.runner.cached_tokens(EngineRequest(second, greedy(4)))
        length = len(second.input_ids)
        assert 0 < cached < length
        # the benchmarks swap settings between runs the same way; read at every step
        engine.config = dataclasses.replace(engine.config,
                                            max_num_batched_tokens=length - cached + 1)
        chunked = []
        start = engine.runner.start_chunked
        engine.runner.start_chunked = lambda row: (chunked.append(row), start(row))[1]
        before = engine.stats["prefill_tokens_total"]
        reuse = run(engine, second)
        assert reuse.num_cached_tokens == cached and not chunked
        assert engine.stats["prefill_tokens_total"] - before == length - cached
        assert_generate_logits(engine, logits, reuse, second, 4)
    finally:
        engine.close()


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_size_sets_the_grain_of_a_cached_prefix(block_size):
    """``--block-size`` (vLLM's flag) reaches the prefix cache: the second question about the
    same image reuses a whole number of blocks of that size, covering the image, and the
    cache holds blocks of that many tokens."""
    model = llm("qwen2_5_vl")
    first, second, _ = shared_prompts("qwen2_5_vl")
    engine = Engine(model.loaded, EngineConfig(block_size=block_size, encoder_cache_gb=0))
    try:
        run(engine, first)
        reuse = run(engine, second)
        assert engine.runner.prefix_cache.block_size == block_size
        assert reuse.num_cached_tokens % block_size == 0
        assert reuse.num_cached_tokens > media_span(engine, second)[1]
        shared = next(i for i, (a, b) in enumerate(zip(first.input_ids, second.input_ids,
                                                      strict=False)) if a != b)
        assert reuse.num_cached_tokens == shared // block_size * block_size
    finally:
        engine.close()


def test_a_full_cache_keeps_the_blocks_a_mixed_prefill_just_looked_up():
    """A cache at its bound, a step that admits a cached prompt beside a new one: the new
    one's blocks are stored only after the cached one's were taken, so storing them cannot
    evict what the step is about to use (the prefill never fails and is never retried alone),
    and the logits are the model's own."""
    model = llm("qwen2_vl")
    first, second, other = shared_prompts("qwen2_vl")
    probe = Engine(model.loaded, EngineConfig(encoder_cache_gb=0))
    try:
        run(probe, first)
        stats = probe.runner.prefix_cache.stats
        block, blocks = stats.bytes // stats.blocks, stats.blocks
    finally:
        probe.close()
    # room for exactly the first prompt's blocks: the other prompt's evict them
    engine = Engine(model.loaded, EngineConfig(encoder_cache_gb=0,
                                               prefix_cache_gb=blocks * block / (1 << 30)),
                    batch_wait_s=1.0)
    failures: list[BaseException] = []
    prefill = engine.runner.prefill

    def watched(rows):
        try:
            return prefill(rows)
        except BaseException as exc:
            failures.append(exc)
            raise

    engine.runner.prefill = watched
    logits = record_logits(engine)
    try:
        run(engine, first)
        reqs = [engine.submit(EngineRequest(p, greedy(4))) for p in (other, second)]
        for r in reqs:
            assert r.done.wait(120) and r.error is None, r.error
        assert failures == []
        assert reqs[1].num_cached_tokens > media_span(engine, second)[1]
        assert_generate_logits(engine, logits, reqs[1], second, 4)
        assert_generate_logits(engine, logits, reqs[0], other, 4)
    finally:
        engine.close()


def test_a_cache_salt_seeds_every_block_hash():
    """vLLM's cache_salt: the same tokens under two salts (or one and none) share no block;
    under the same salt, all of them."""
    from engine.executor.prefix_cache import block_hashes

    tokens = list(range(64))
    plain, a, b = (block_hashes(tokens, 16, salt=s) for s in (None, "a", "b"))
    assert len(plain) == len(a) == 4
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert block_hashes(tokens, 16, salt="a") == a
