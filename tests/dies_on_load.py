"""A kernel module that ends its process when a worker imports it (a broken extension, say)."""
import multiprocessing
import os
from dataclasses import replace

from tests.torch_kernels import torch_kernel

if multiprocessing.current_process().name == "nanfuzz-worker":
    os._exit(7)

kernel = replace(torch_kernel(), name="torch@dies-on-load", spec="tests.dies_on_load:kernel")
