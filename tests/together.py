"""Running functions in threads started together (a barrier), for the concurrency tests."""
from __future__ import annotations

import threading


def together(fns) -> list:
    """Each fn in a thread of its own, started together; their results, or the first exception."""
    results, errors = [None] * len(fns), []
    barrier = threading.Barrier(len(fns))

    def run(i):
        try:
            barrier.wait()
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - reraised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
