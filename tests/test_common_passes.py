"""rayexport.common.passes: the bytes each phase's passes touch, counted from several threads and
added up over the workers, as the report gives them."""

import threading

from rayexport.common.passes import Passes, per_byte, summed


def test_counts_from_two_threads_add_up_and_workers_sum_phase_by_phase():
    passes = Passes()
    count = passes.counter("transfer")

    def add_many():
        for _ in range(20000):
            count("hashed", 2)

    threads = [threading.Thread(target=add_many) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    passes.counter("source_scan")("read", 0)  # a zero count leaves no trace
    assert passes.snapshot() == {"transfer": {"hashed": 80000}}
    other = {"transfer": {"hashed": 20000, "written": 10000}, "verify_files": {"read": 10000}}
    total = summed([passes.snapshot(), other])
    assert total == {"transfer": {"hashed": 100000, "written": 10000}, "verify_files": {"read": 10000}}
    assert per_byte(total, 10000) == {"transfer": {"hashed": 10.0, "written": 1.0}, "verify_files": {"read": 1.0}}
    assert per_byte(total, 0) == {}
