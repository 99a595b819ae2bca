"""Pictures of what meshtrain does (``meshtrain viz ...``): pipeline schedules as Gantt charts."""

from .schedule import Trace, draw_timeline, load_trace, read_trace

__all__ = ["Trace", "draw_timeline", "load_trace", "read_trace"]
