"""The time budget of a benchmark run: work stops starting (and running work is interrupted) when
it is spent, so that a run on a leased device always ends with its results written."""
from __future__ import annotations

import contextlib
import signal
import threading
import time


class BudgetExceeded(BaseException):
    """Raised (from SIGALRM) when a benchmark's time budget is spent (not an Exception, so that
    code catching errors does not swallow it)."""


class Budget:
    """Seconds from now until the benchmark must stop starting and running work (`reserve`
    seconds kept back for writing the results). `guard()` runs a piece of work under a timer."""

    def __init__(self, seconds: float, reserve: float | None = None, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.seconds = seconds
        self.reserve = min(10.0, 0.05 * seconds) if reserve is None else reserve
        self.expired = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.reserve - self.elapsed()

    @contextlib.contextmanager
    def guard(self, limit: float | None = None):
        """Raise BudgetExceeded in the body once the budget is spent (or `limit` seconds, if
        less, have passed: then the budget itself is not marked expired)."""
        left = self.left() if limit is None else min(self.left(), limit)
        if left <= 0:
            self.expired = self.left() <= 0
            raise BudgetExceeded()
        timer = (threading.current_thread() is threading.main_thread()
                 and hasattr(signal, "setitimer"))
        old = None
        if timer:
            def on_alarm(signum, frame):
                self.expired = self.left() <= 0.5
                raise BudgetExceeded()

            old = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, left)
        try:
            yield
        finally:
            if timer:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)


def attempt(budget: Budget, row: dict, fn, log, what: str, limit: float | None = None) -> bool:
    """Run fn() under the budget (and `limit` seconds); on failure record it in `row` ("error" /
    "skipped") and go on. True when fn finished."""
    try:
        with budget.guard(limit):
            fn()
        return True
    except BudgetExceeded:
        row["skipped"] = (f"time budget ({budget.seconds:.0f} s) spent" if budget.expired else
                          f"time budget: stopped after {limit:.0f} s (the rest is kept for the "
                          "split)")
        log(f"  {what}: stopped ({row['skipped']})")
    except Exception as e:  # noqa: BLE001  (keep the rest of the table)
        import traceback

        if budget.expired:
            row["skipped"] = f"time budget ({budget.seconds:.0f} s) spent"
        else:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        log(f"  {what}: FAILED {type(e).__name__}: {str(e)[:300]}\n"
            f"{traceback.format_exc(limit=4)[-1500:]}")
    return False
