"""The vLLM bridge's answers to an API server (engine.vllm_bridge.serve.PassSender), over a
real socket pair: the token events of one loop pass go as one message, a request's events
always before its Done, and a later pass is a later message. Runs in this project's
environment: the bridge module loads vLLM only when it serves."""

from __future__ import annotations

import asyncio
from multiprocessing import Pipe

from engine.server.process.outbox import Outbox
from engine.server.process.wire import Delta, Done, Events, Output
from engine.vllm_bridge.serve import PassSender


def _delta(rid: str, token: int) -> Delta:
    return Delta(rid, 0, token, f"t{token}", None, None)


def test_one_pass_is_one_message_and_a_done_follows_its_events():
    reader, writer = Pipe(duplex=True)

    async def main() -> None:
        sender = PassSender(asyncio.get_running_loop(), Outbox(writer))
        # pass 1: two requests' outputs of one step, then one of them ends
        sender.send(Events([_delta("a", 1)]))
        sender.send(Events([_delta("b", 2), _delta("b", 3)]))
        sender.send(Done("b", [Output(0, "t2t3", [2, 3], "length")], {}))
        sender.send(Events([_delta("a", 4)]))
        await asyncio.sleep(0.01)  # the loop goes round: the pass's events go out
        # pass 2
        sender.send(Events([_delta("a", 5)]))
        await asyncio.sleep(0.01)
        sender.outbox.close()

    asyncio.run(main())
    got = []
    while reader.poll(2.0):
        got.append(reader.recv())
        if len(got) == 4:
            break
    assert [type(m).__name__ for m in got] == ["Events", "Done", "Events", "Events"]
    # b's Done came after b's tokens (and a's token sent before it), in one message
    assert [(d.rid, d.token_id) for d in got[0].deltas] == [("a", 1), ("b", 2), ("b", 3)]
    assert got[1].rid == "b"
    # what the pass produced after the Done went out at the end of that pass, not per output
    assert [(d.rid, d.token_id) for d in got[2].deltas] == [("a", 4)]
    assert [(d.rid, d.token_id) for d in got[3].deltas] == [("a", 5)]
    assert not reader.poll(0.1)  # nothing else: no empty Events


def test_vllms_stop_reason_reaches_the_wire_with_the_end():
    """vLLM's ``CompletionOutput.stop_reason`` (a stop string or token id) travels on the
    Delta that ends its row and on the row's Output; null before the end."""
    from types import SimpleNamespace

    from engine.vllm_bridge.serve import Bridge

    def step(text, tokens, finish=None, stop=None):
        return SimpleNamespace(outputs=[SimpleNamespace(
            index=0, text=text, token_ids=tokens, logprobs=None, finish_reason=finish,
            stop_reason=stop)])

    texts, ids, reasons = {}, {}, {}
    params = SimpleNamespace(logprobs=None)
    first = Bridge.deltas("r", step("ab", [1, 2]), texts, ids, reasons, params, 0)
    last = Bridge.deltas("r", step("c", [3], "stop", "STOP"), texts, ids, reasons, params, 0)
    assert [d.stop_reason for d in first + last] == [None, None, "STOP"]
    assert reasons == {0: ("stop", "STOP")}
    ended = Bridge.deltas("s", step("", [], "stop", 7), {}, {}, {}, params, 0)
    assert [(d.token_id, d.finish_reason, d.stop_reason) for d in ended] == [
        (None, "stop", 7)]
