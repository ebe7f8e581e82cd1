"""Test helper: run a call with a time limit, so a regression that blocks fails the test instead of hanging it."""
from __future__ import annotations

import threading


def within(seconds: float, fn, *args):
    """``fn(*args)`` on a daemon thread; fail the test if it is still running after ``seconds``."""
    box: list = []

    def target():
        try:
            box.append((True, fn(*args)))
        except BaseException as e:   # re-raised in the test's thread
            box.append((False, e))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)}{args!r:.200} still blocked after {seconds} s"
    ok, value = box[0]
    if not ok:
        raise value
    return value
