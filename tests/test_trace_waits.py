"""tests/trace_waits.py on made-up traces: a kernel launched before a copy ended that starts only when the copy ends
waited for it; a kernel launched late (the host's gap) did not; scheduling within the tolerance is no wait."""

from trace_waits import copy_waits


def _kernel(ts, dur, correlation, stream=7):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}  # fmt: skip


def _launch(ts, correlation, cat="cuda_runtime"):
    return {
        "ph": "X",
        "cat": cat,
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 5,
        "args": {"correlation": correlation},
    }


COPY = [(100.0, 700.0)]  # one copy on the side stream


def test_a_kernel_queued_behind_a_copy_waited():
    # kernel 2 launched at 110 (the stream idle from 100) starts at 700, when the copy ends: 590 us idle, less 50
    events = [_launch(0, 1), _kernel(10, 90, 1), _launch(110, 2, "cuda_driver"), _kernel(700, 10, 2)]
    result = copy_waits(events, 7, COPY)
    assert result == {"waited": 540.0, "host_bound": 10.0}


def test_a_gap_the_host_left_is_not_a_wait():
    # kernel 2 launched at 690, started at 705: the stream had nothing to do during the copy
    events = [_launch(0, 1), _kernel(10, 90, 1), _launch(690, 2), _kernel(705, 10, 2)]
    assert copy_waits(events, 7, COPY) == {"waited": 0.0, "host_bound": 590.0}


def test_work_during_the_copy_and_other_streams_are_no_wait():
    events = [
        _launch(0, 1), _kernel(10, 400, 1), _launch(20, 2), _kernel(440, 300, 2),  # 30 us of scheduling: tolerated
        _launch(30, 3), _kernel(150, 600, 3, stream=46),  # the copy stream's own work is not the compute stream's
    ]  # fmt: skip
    assert copy_waits(events, 7, COPY) == {"waited": 0.0, "host_bound": 0.0}
