"""This process's resident memory, from Linux's /proc (the peak, now, and a fresh start for
the peak), for the reports' per-process numbers."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started or since `reset_peak_rss()`."""
    return status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident memory now."""
    return status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Start measuring the peak afresh (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory field of /proc/PID/status (`VmHWM`, `VmRSS`, ...) in bytes; 0 where there is
    none (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
