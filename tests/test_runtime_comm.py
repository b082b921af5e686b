"""octorun's transport: a rank lets go of what it sent as it goes, and a receive posted ahead
of need may wait longer than any timeout its channel was created with."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time

import torch

import runtime_helpers as h
from octorun import comm
from octorun.comm import Channel, Transport
from octorun.lowering import ACT, GRAD, Message


class _Work:
    def __init__(self, done: bool = True):
        self.done = done
        self.waited = False

    def wait(self, timeout):
        self.waited = True
        return self.done


def _transport(monkeypatch, works: list[_Work], *, done: bool = True) -> Transport:
    def isend(tensor, dst, group, tag):
        works.append(_Work(done))
        return works[-1]

    monkeypatch.setattr(comm.dist, "isend", isend)
    return Transport(outgoing={1: Channel(0, 1, None, None)}, incoming={}, device=torch.device("cpu"), rounds=lambda: [False], timeout_s=5)


def test_sends_are_let_go_one_op_later_not_at_the_end_of_the_step(monkeypatch):
    works: list[_Work] = []
    transport = _transport(monkeypatch, works)
    deadline = time.monotonic() + 5
    held = []
    for mb in range(4):  # one op per microbatch, each sending a header and one tensor (step 0)
        assert transport.begin_op(deadline=deadline) is None
        transport.send(Message(ACT, 1, mb, 0, 1), (torch.ones(3),), dst=1, step=0)
        held.append(transport.sends_in_flight)
    # the previous op's sends stay in flight while the next op runs, older ones are waited for
    assert held == [2, 4, 4, 4]
    assert [w.waited for w in works] == [True] * 4 + [False] * 4
    assert transport.wait_sends(deadline=deadline) is None
    assert transport.sends_in_flight == 0 and all(w.waited for w in works)


def test_a_send_that_does_not_complete_is_named(monkeypatch):
    works: list[_Work] = []
    transport = _transport(monkeypatch, works, done=False)
    late = Message(GRAD, 2, 0, 0, 1)
    transport.begin_op(deadline=time.monotonic() + 5)
    transport.send(late, (torch.ones(2),), dst=1, step=0)
    transport.begin_op(deadline=time.monotonic() + 5)
    assert transport.begin_op(deadline=time.monotonic() + 5) == late


GROUP_TIMEOUT_S = 1.0
LATE_S = 3 * GROUP_TIMEOUT_S  # the sender sends only this late


def _late_exchange(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S), backend="gloo")
    message = Message(ACT, 1, 0, 0, 1)
    channel = Channel(0, 1, group, group, messages=(message,))
    outcome = "?"
    try:
        if rank == 0:
            transport = Transport(outgoing={1: channel}, incoming={}, device=torch.device("cpu"), rounds=lambda: [False], timeout_s=30)
            time.sleep(LATE_S)
            transport.send(message, (torch.arange(4.0),), dst=1, step=0)
            outcome = str(transport.wait_sends(deadline=time.monotonic() + 30))
        else:
            transport = Transport(outgoing={}, incoming={0: channel}, device=torch.device("cpu"), rounds=lambda: [False], timeout_s=30)
            transport.start()  # its thread posts the receive now, LATE_S before the send
            (value,), _ = transport.mailbox.take(0, message, src=0, deadline=time.monotonic() + 30)
            outcome = str(value.tolist())
    except Exception as exc:
        outcome = f"failed: {exc}"
    with open(os.path.join(folder, f"rank{rank}.txt"), "w") as out:
        out.write(outcome)
    dist.barrier()
    os._exit(0)


def test_a_receive_outlives_its_channels_timeout(tmp_path):
    """A receiver thread posts each receive ahead of need, so it may wait for most of a step
    (or, for the next step's first message, beyond it): the channel's creation timeout must
    not end it. With the group's timeout as the receive's, this failed after 1 s."""
    ctx = multiprocessing.get_context("spawn")
    port = h.free_port()
    procs = [ctx.Process(target=_late_exchange, args=(rank, port, str(tmp_path))) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(90)
        if proc.is_alive():
            proc.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert (tmp_path / "rank0.txt").read_text() == "None"  # no send was late
    assert (tmp_path / "rank1.txt").read_text() == "[0.0, 1.0, 2.0, 3.0]"
