"""This process's resident memory, from Linux's /proc (the peak, now, and a fresh start for
the peak), for the reports' per-process numbers."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started or since `reset_peak_rss()`."""
    return _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident memory now."""
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Start measuring the peak afresh (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
