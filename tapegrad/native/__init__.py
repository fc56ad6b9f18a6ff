"""The native backend: generated C, its build cache, the fusion planner and the ctypes runner."""
