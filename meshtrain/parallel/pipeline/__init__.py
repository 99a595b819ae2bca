"""Pipeline parallelism: schedules as data (this package's ``schedule`` module) that one engine runs.

Re-exports the schedule API: build, check, simulate and measure AFAB / 1F1B / interleaved schedules.
"""

from .schedule import (
    SCHEDULES,
    Action,
    ScheduleError,
    bubble_fraction,
    build_schedule,
    check_schedule,
    peak_in_flight,
    simulate,
    theoretical_bubble,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "ScheduleError",
    "bubble_fraction",
    "build_schedule",
    "check_schedule",
    "peak_in_flight",
    "simulate",
    "theoretical_bubble",
]
