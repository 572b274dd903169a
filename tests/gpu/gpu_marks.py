"""Markers shared by GPU test modules: whether a GPU runs them, and the device their tensors go to.

SPECD_TEST_GPU_DRYRUN=1 runs the GPU tests' logic with CPU tensors on a machine without a GPU (the CPU
op then stands in for the GPU op, so the checks are self-comparisons: a check of the tests, not of the
GPU backend).
"""
import os

import pytest

import specd.native as sn

DRYRUN = os.environ.get("SPECD_TEST_GPU_DRYRUN") == "1"
GPU = sn.Device.GPU
DEV = sn.Device.CPU if DRYRUN else GPU
HAVE_GPU = sn.gpu_available() or DRYRUN


def gpu_only(f):
    """Skips f without a GPU backend and device (unless DRYRUN); marks it `gpu`."""
    f = pytest.mark.skipif(not HAVE_GPU, reason="no GPU backend/device in this build or machine")(f)
    return pytest.mark.gpu(f)
