"""tests/served.py's asks: the same flags in another order are one server; what differs
(engine, flags, environment, ``fresh``) is another; a mark it cannot read is refused."""

from __future__ import annotations

import pytest

from tests import served


def ask(*flags, engines=("ours",), **kwargs) -> list[served.Serve]:
    return served.asks(pytest.mark.serve(*flags, **kwargs).mark,
                       pytest.mark.engines(*engines).mark)


def test_flags_in_another_order_are_the_same_ask_and_values_stay_with_their_flag():
    one = ask("--api-key", "a", "--api-key", "b", "--max-model-len", "64", "--no-x")
    other = ask("--no-x", "--max-model-len", 64, "--api-key", "b", "--api-key", "a")
    assert one == other and len(set(one)) == 1
    assert one[0].flags == ("--api-key", "a", "--api-key", "b", "--max-model-len", "64",
                            "--no-x")


def test_engines_env_and_fresh_make_other_asks():
    both = ask("--x", engines=("ours", "vllm"))
    assert [a.engine for a in both] == ["ours", "vllm"] and both[0] != both[1]
    assert ask("--x")[0] == both[0]
    assert ask("--x", env={"A": "1"})[0] != both[0]
    assert ask("--x", fresh="kills it")[0] != both[0]
    assert ask("--x", fresh="kills it")[0].id == "ours-kills it"
    assert ask("--x", "1")[0] != both[0]


def test_a_mark_it_cannot_read_is_refused():
    with pytest.raises(TypeError, match="model, env, fresh and prepare"):
        ask("--x", flags=["--y"])
    with pytest.raises(ValueError, match="the engines are"):
        ask(engines=("sglang",))


def test_each_ask_stops_after_its_last_test_in_the_run_order():
    class Item:
        def __init__(self, nodeid, ask=None):
            self.nodeid = nodeid
            if ask is not None:
                self.callspec = type("CallSpec", (), {"params": {"served": ask}})()

    a, b = ask("--a")[0], ask("--b")[0]
    last = served.last_tests([Item("t1", a), Item("t2"), Item("t3", a), Item("t4", b)])
    assert last == {a: "t3", b: "t4"}
