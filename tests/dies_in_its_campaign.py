"""A kernel module that ends the campaign process of a run of several kernels when that process
imports it (a kernel whose host code ends its caller outside any launch)."""
import multiprocessing
import os
from dataclasses import replace

from tests.torch_kernels import torch_kernel

if multiprocessing.current_process().name.startswith("nanfuzz-campaign"):
    os._exit(7)

kernel = replace(torch_kernel(), name="torch@dies-in-its-campaign", spec="tests.dies_in_its_campaign:kernel")
