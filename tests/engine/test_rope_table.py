"""The decode step's rotary table (engine.models.rope_table) on real tiny models' rotary
embeddings: every lookup is the bits the model's own module gives the same positions, for
M-RoPE (Qwen2.5-VL) and plain RoPE (Llama, Qwen2) text models, batch by batch, as the table
grows; what it does not take goes to the module."""

from __future__ import annotations

import pytest
import torch

from engine.models import parts, rope_table
from tests.engine_fixtures import llm


def rotary_of(arch: str):
    return parts.language_model(llm(arch).engine.runner.model).rotary_emb


def step_positions(values: list[int], mrope: bool) -> torch.Tensor:
    """Positions as the runner gives a decode step."""
    text = torch.tensor([[v] for v in values], dtype=torch.long)
    return text.unsqueeze(0).expand(3, -1, -1) if mrope else text


@pytest.mark.parametrize(("arch", "mrope"), [("qwen2_5_vl", True), ("llava", False),
                                             ("qwen2_audio", False)])
def test_lookups_are_the_modules_bits(arch, mrope):
    rotary = rotary_of(arch)
    table = rope_table.RopeTable(rotary)
    assert table.enabled
    generator = torch.Generator().manual_seed(0)
    hidden = torch.zeros(1, 1, 8)
    with torch.inference_mode():
        # first small positions, then ones past every block built so far (the table grows;
        # 1100 leaves its store room to spare, 1500 is past the filled rows but within it),
        # then batches that mix old and new ones, rows of one to 9
        for high in (5, 70, 200, 1000, 1100, 1500, 3000, 3000):
            rows = int(torch.randint(1, 10, (1,), generator=generator))
            values = torch.randint(0, high, (rows,), generator=generator).tolist()
            values[0] = high - 1
            positions = step_positions(values, mrope)
            cos, sin = table(hidden, positions)
            own_cos, own_sin = rotary(hidden, positions)
            assert cos.shape == own_cos.shape and sin.shape == own_sin.shape
            assert torch.equal(cos, own_cos) and torch.equal(sin, own_sin), values
    assert table._tables, "the lookups went to the module instead of the table"
    filled, store = next(iter(table._tables.values())), next(iter(table._stores.values()))
    assert filled[0].shape[0] % rope_table.BLOCK == 0 and filled[0].shape[0] >= 3000
    assert store[0].shape[0] >= filled[0].shape[0]


def test_what_the_table_does_not_take_goes_to_the_module(monkeypatch):
    rotary = rotary_of("qwen2_5_vl")
    table = rope_table.RopeTable(rotary)
    hidden = torch.zeros(1, 1, 8)
    calls = []

    def counted(x, positions):
        calls.append(positions.shape)
        return rotary(x, positions)

    table.rotary = counted
    with torch.inference_mode():
        # three sections that differ (a prefill's image positions: not a decode step's)
        mixed = torch.tensor([[[3]], [[4]], [[5]]])
        assert torch.equal(table(hidden, mixed)[0], rotary(hidden, mixed)[0])
        assert calls == [mixed.shape]
        # past the table's limit: the module, and the table is not built that far
        monkeypatch.setattr(rope_table, "MAX_POSITIONS", 128)
        far = step_positions([500], mrope=True)
        assert torch.equal(table(hidden, far)[0], rotary(hidden, far)[0])
        assert calls[-1] == far.shape and not table._tables
    dynamic = rope_table.RopeTable(rotary)
    monkeypatch.setattr(rotary, "rope_type", "dynamic")
    assert not rope_table.RopeTable(rotary).enabled and dynamic.enabled
