"""cupy.cuda stand-in: one device (id 0) with ``STANDIN_SMS`` multiprocessors (132 by default)."""

from __future__ import annotations

import os

from . import driver

_state = {"sms": int(os.environ.get("STANDIN_SMS", "132"))}


def set_sms(n: int) -> None:
    """The multiprocessor count Device().attributes reports from now on."""
    _state["sms"] = int(n)


def set_occupancy(n: int) -> None:
    driver.set_occupancy(n)


class Device:
    def __init__(self, device=None, id=None):
        device = id if device is None else device
        if device is not None and int(device) != 0:
            raise ValueError(f"the stand-in has device 0 only, got {device!r}")
        self.id = 0

    @property
    def attributes(self) -> dict[str, int]:
        return {
            "MultiProcessorCount": _state["sms"],
            "MaxThreadsPerBlock": 1024,
            "MaxGridDimX": 2**31 - 1,
            "MaxGridDimY": 65535,
            "MaxGridDimZ": 65535,
            "WarpSize": 32,
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return "<CUDA Device 0 (CPU stand-in)>"
