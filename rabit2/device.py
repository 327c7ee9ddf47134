"""Device arrays (cupy, the ``gpu`` extra) in the collectives: staged through host memory.

Each collective copies a device array to a host array, runs the host collective on it and
copies the result back, all on the current CUDA stream: the device-to-host copy waits for
the work queued on that stream before it, and work queued after the call sees the result.
The bytes on the wire are the host collective's, so a job may mix ranks that pass device
arrays with ranks that pass numpy arrays.  docs/user-guide.md, "Device arrays", says what
each call returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def is_device_array(data: Any) -> bool:
    """Whether ``data`` is a cupy array (by its module: cupy need not be imported to ask)."""
    return (hasattr(data, "__cuda_array_interface__")
            and type(data).__module__.partition(".")[0] == "cupy")


def to_host(data: Any) -> np.ndarray:
    """A C-contiguous host copy of the device array ``data``, in page-locked memory from
    cupy's pool (which copies several times faster than pageable memory and is reused from
    call to call); it waits for the work queued before it on the current stream."""
    import cupyx  # noqa: PLC0415 - optional dependency (rabit2[gpu])

    host: np.ndarray = cupyx.empty_pinned(data.shape, dtype=data.dtype)
    with data.device:
        data.get(out=host)
    return host


def to_device(host: np.ndarray) -> Any:
    """A new device array of ``host``'s bytes on the current device, its copy finished, or
    ``host`` itself where cupy cannot be imported or finds no GPU (a rank without one
    receiving a device array)."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency (rabit2[gpu])
    except ImportError:
        return host
    if not cupy.cuda.is_available():  # (cupy installed, no GPU or driver here)
        return host
    out = cupy.asarray(host)
    cupy.cuda.get_current_stream().synchronize()  # (usable from any stream once returned)
    return out


def copy_into(data: Any, host: np.ndarray) -> None:
    """Write ``host`` (same shape and dtype) into the device array ``data``, which may be a
    strided view, on its own device."""
    import cupy  # noqa: PLC0415 - optional dependency (rabit2[gpu])

    with data.device:
        stream = cupy.cuda.get_current_stream()  # (work queued after the call waits for it)
        if data.flags.c_contiguous:
            data.set(host, stream=stream)
        else:
            data[...] = cupy.asarray(host)
        stream.synchronize()  # (before ``host`` goes back to the pool)


def matches(data: Any, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    """Whether the device array ``data`` can receive an array of ``dtype`` and ``shape``."""
    return np.dtype(data.dtype) == dtype and tuple(data.shape) == shape


def on_callers_stream(fn: Callable[..., T], data: Any) -> Callable[..., T]:
    """``fn``, to be run on another thread, after the work queued on this thread's current
    CUDA stream until now, when ``data`` is a device array; ``fn`` itself otherwise.

    cupy's current stream belongs to a thread (and under ``CUPY_CUDA_PER_THREAD_DEFAULT_
    STREAM`` the default stream does too), so the other thread cannot use it: an event
    recorded here now, which a stream of the call's own waits for, orders the call after
    that work and after nothing queued later."""
    if not is_device_array(data):
        return fn
    import cupy  # noqa: PLC0415 - optional dependency (rabit2[gpu])

    device = data.device
    with device:
        queued = cupy.cuda.Event(disable_timing=True)
        queued.record()  # (on this thread's current stream)

    def run(*args: Any) -> T:
        with device:
            stream = cupy.cuda.Stream(non_blocking=True)
            stream.wait_event(queued)
            with stream:
                return fn(*args)

    return run


__all__ = ["copy_into", "is_device_array", "matches", "on_callers_stream", "to_device",
           "to_host"]
