"""Where each kernel library's source tree comes from: the keyword it travels as (``resolve()``'s and
Settings' field), its command-line option and its environment variable.  Nothing here imports torch:
the command line reads it before the fork server has started."""
from __future__ import annotations

import argparse

# The prefix of a library's kernel names: (its keyword, what the folder given for it holds).
SOURCES = {
    "vllm": ("vllm_src", "a vLLM source tree or unpacked wheel"),
    "aiter": ("aiter_src", "an AITER source tree or unpacked amd-aiter wheel"),
    "fa_amd": ("fa_src", "an unpacked flash-attn source distribution or checkout"),
    "sglang": ("sglang_src", "an SGLang source tree or unpacked sglang wheel"),
    "lmdeploy": ("lmdeploy_src", "an lmdeploy source tree or unpacked lmdeploy wheel"),
}


def add_source_options(parser: argparse.ArgumentParser) -> None:
    """``--vllm-src DIR`` and its siblings, one per library."""
    for library, (keyword, what) in SOURCES.items():
        parser.add_argument("--" + keyword.replace("_", "-"), metavar="DIR",
                            help=f"{what} for the {library}:* kernels (or NANFUZZ_{keyword.upper()})")
