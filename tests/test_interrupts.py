"""Ctrl+C and SIGTERM held back for the steps that must not stop half way (cli.interrupts_held),
and the DDP run's driver loop that relies on it (__main__.interruptible). Real signals, sent
to this process, in the main thread, as a terminal or `kill` sends them."""

import os
import signal
import threading
import time

import pytest

from sweeper.signals import interrupts_held, stop_on_sigterm_as_on_ctrl_c
from sweeper.single_run import interruptible


@pytest.fixture(autouse=True)
def plain_ctrl_c():
    """Python's own Ctrl+C handler for each test: a DDP test earlier in the session leaves
    Ray Train's in place, process-wide."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def sigterm_as_ctrl_c():
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm_as_on_ctrl_c()
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_inside_the_block_is_raised_when_it_ends(signum, sigterm_as_ctrl_c):
    done = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # the handler has run by now: without the hold, this raised
        done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_second_interrupt_is_raised_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        done.append("after the first")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        done.append("after the second")
    assert done == ["after the first"]


def test_an_ignored_ctrl_c_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_the_block_runs_as_it_is():
    seen = []

    def other():
        with interrupts_held():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_a_tick_loses_nothing_the_tick_took(signum, sigterm_as_ctrl_c):
    """The DDP run's tick takes rank 0's evaluations off a queue and hands them to the
    logger; an interrupt between the two lost them (the CI failure this was for)."""
    queue = [{"step": 5, "val_bpb": 3.1}]
    logged = []
    release = threading.Event()

    def fit():
        release.wait(timeout=30)

    def tick():
        taken, queue[:] = list(queue), []
        if taken:
            os.kill(os.getpid(), signum)  # the interrupt lands between take and hand-over
            time.sleep(0.05)
        logged.extend(taken)

    try:
        with pytest.raises(KeyboardInterrupt):
            interruptible(fit, tick)
    finally:
        release.set()
    assert logged == [{"step": 5, "val_bpb": 3.1}]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_after_an_interrupt_the_hook_runs_once_the_cluster_is_down(signum, sigterm_as_ctrl_c):
    """run_ddp's hook logs from rank 0's checkpoint record what rank 0 sent after the last
    tick (the queue goes with the cluster); it runs after an interrupt, and only then."""
    calls = []
    release = threading.Event()

    def fit():
        time.sleep(0.2)  # training, when the interrupt comes
        os.kill(os.getpid(), signum)
        release.wait(timeout=30)

    try:
        with pytest.raises(KeyboardInterrupt):
            interruptible(fit, lambda: calls.append("tick"), lambda: calls.append("after"))
    finally:
        release.set()
    assert calls[-2:] == ["tick", "after"] and calls.count("after") == 1
    calls.clear()
    interruptible(lambda: None, lambda: calls.append("tick"), lambda: calls.append("after"))
    assert "after" not in calls and calls[-1] == "tick"
