"""Signal handling of the commands: SIGTERM as Ctrl+C, interrupts held over short critical
steps, a quiet end when a pipe closes, and no garbage collection at exit."""

from __future__ import annotations

import contextlib


def skip_the_collection_at_exit() -> None:
    """Python's exit ends with a garbage collection over every object still alive: 4 s
    after a sweep's last line (Hydra, MLflow, Ray and torch in memory). Frozen objects are
    left out and the OS frees them; the atexit handlers (Ray's shutdown, the MLflow queue's
    flush) still run, and every file sweeper writes is closed where it is written."""
    import atexit
    import gc

    atexit.register(gc.freeze)  # before the run registers its own: it runs after them


def stop_on_sigterm_as_on_ctrl_c() -> None:
    """SIGTERM to the driver (`kill`, `docker stop`) ends a run or a sweep the way Ctrl+C
    does (a failed result.json; a sweep's state saved and how to resume), not at once with
    a dump of the native stack. ray.init installs that dump handler, so start_ray calls
    this again after it. (`timeout` signals the whole process group, Ray's processes too:
    then only the state saved each second is left to resume from.)"""
    import os
    import signal
    import threading

    def on_sigterm(signum, frame):
        if callable(signal.getsignal(signal.SIGINT)):
            # through SIGINT, not a raise here: inside tuner.fit() Tune's own SIGINT handler
            # stops the trials and saves the experiment before it returns
            os.kill(os.getpid(), signal.SIGINT)
        else:
            # SIGINT is ignored: a shell without job control (a script, `nohup cmd &`)
            # starts background jobs so. A SIGINT would be lost, and `kill` with it.
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def interrupts_held():
    """Holds a Ctrl+C (or SIGTERM) that arrives inside the block until the block is done,
    then raises it as KeyboardInterrupt; a second one is raised at once, so a block that
    hangs can still be left. For steps that must not stop half way (an evaluation taken off
    the DDP queue but not yet logged). Only the main thread can set signal handlers;
    elsewhere the block runs as it is. An ignored signal stays ignored."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(signum)):
            previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        raise KeyboardInterrupt


def end_quietly_when_output_closes() -> None:
    """A command piped into `head` or `less` ends silently when the reader quits, as `cat`
    does, not with a BrokenPipeError traceback (Python ignores SIGPIPE). Only for commands
    that print and change nothing: a sweep has a Ray cluster and a state file to close."""
    import signal

    if hasattr(signal, "SIGPIPE"):  # not on Windows
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
