"""A 32-bit value written into device memory from a stream's queue: the driver's stream memory
operation (cuStreamWriteValue32), which the GPU's front end carries out once the work queued
before it is done, with the writes of that work visible first. A slot's ready mark written so
takes no turn of the copy engine: a 4-byte host-to-device copy behind each expert's data cost
~10 us of the link an expert, 5% on the H200 box.
"""

from __future__ import annotations

import ctypes
import functools

import torch


def stream_writer(device_index: int):
    """-> write(stream handle, device address, value) on this CUDA device, or None where the
    driver has no stream memory operations (the caller copies the value instead)."""
    return _driver_writer(device_index)


@functools.cache
def _driver_writer(device_index: int):
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    # CUDA 12 headers map the name to _v2; older drivers export the plain one only
    call = getattr(driver, "cuStreamWriteValue32_v2", None) or getattr(
        driver, "cuStreamWriteValue32", None
    )
    if call is None:
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    call.restype = ctypes.c_int

    def write(stream: int, address: int, value: int) -> None:
        status = call(stream, address, value, 0)  # 0: default, a system-scope fence first
        if status:
            raise RuntimeError(f"cuStreamWriteValue32 failed with CUDA error {status}")

    return write if _works(write, device_index) else None


def _works(write, device_index: int) -> bool:
    """Whether a value written so lands (some virtualised drivers refuse the operation)."""
    target = torch.full((1,), -1, dtype=torch.int32, device=f"cuda:{device_index}")
    stream = torch.cuda.current_stream(device_index)
    try:
        write(stream.cuda_stream, target.data_ptr(), 12345)
        stream.synchronize()
    except RuntimeError:
        return False
    return int(target.item()) == 12345
