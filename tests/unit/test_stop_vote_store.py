"""The stop agreed through the store (training/stop_vote.py), with a real TCPStore on 127.0.0.1 and one thread per
rank playing its loop: each step ends in a barrier every rank must reach (the step's collective), so a rank that
went past the agreed step, or one waiting at its boundary for a decision that never comes, would hang the others."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from hlat.training.stop_vote import StopVote, decide_stop_step

RANKS = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_decision_is_the_largest_post_and_none_at_the_last_step() -> None:
    assert decide_stop_step([6, 7, 6, 6], max_steps=100) == 7
    assert decide_stop_step([99, 100], max_steps=100) is None  # the training ends there anyway
    assert decide_stop_step([5], max_steps=6) == 5


def play(asker: int, ask_at: int, max_steps: int, lag: dict[int, float] | None = None) -> list[Any]:
    """RANKS ranks step in lockstep (a barrier per step); `asker` asks for a stop inside step `ask_at`; the step each
    rank stopped after (None: it trained to the end). `lag`: seconds a rank sleeps before its barrier."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))

    def connect() -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))

    votes = [StopVote(r, RANKS, max_steps, passed=0, connect=connect, wait_s=0.5) for r in range(RANKS)]
    for vote in votes:
        vote.start()
    collective = threading.Barrier(RANKS, timeout=20)
    stopped: list[Any] = [None] * RANKS
    errors: list[BaseException] = []

    def loop(rank: int) -> None:
        try:
            for step in range(1, max_steps + 1):
                if rank == asker and step == ask_at:
                    votes[rank].request()
                if lag and rank in lag:
                    threading.Event().wait(lag[rank])
                collective.wait()  # the step's collective: every rank or none
                if votes[rank].at_boundary(step):
                    stopped[rank] = step
                    return
        except BaseException as exc:
            errors.append(exc)
        finally:
            votes[rank].close()

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    assert not errors, errors
    del master
    return stopped


@pytest.mark.parametrize("asker", [0, 2])
def test_every_rank_stops_after_the_same_step_the_one_asked_in_or_the_next(asker: int) -> None:
    stopped = play(asker, ask_at=5, max_steps=1000)
    assert len(set(stopped)) == 1 and stopped[0] in (5, 6), stopped


def test_a_slow_rank_that_has_not_heard_yet_still_lines_up() -> None:
    # Rank 3 lags 0.2 s before every collective: the others wait for it in each barrier, rank 1 asks in step 3.
    stopped = play(1, ask_at=3, max_steps=1000, lag={3: 0.2})
    assert len(set(stopped)) == 1 and stopped[0] in (3, 4), stopped


def test_a_stop_asked_in_the_last_step_is_the_training_end() -> None:
    stopped = play(0, ask_at=6, max_steps=6)
    assert stopped == [None] * RANKS


def test_one_process_stops_at_its_own_request_with_no_store() -> None:
    vote = StopVote(0, 1, 10, passed=0, connect=None)
    vote.start()
    assert not vote.at_boundary(1)
    vote.request()
    assert vote.at_boundary(2)
