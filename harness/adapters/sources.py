"""Where each kernel library's source tree comes from: the keyword it travels as (``resolve()``'s and
Settings' field), its command-line option and its environment variable.  Nothing here imports torch:
the command line reads it before the fork server has started."""
from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

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
                            help=f"{what} for the {library}:* kernels (or {environment_variable(keyword)})")


def environment_variable(keyword: str) -> str:
    """The variable a tree is also given as: "vllm_src" -> "NANFUZZ_VLLM_SRC"."""
    return f"NANFUZZ_{keyword.upper()}"


@contextlib.contextmanager
def given_trees_in_environment(args: argparse.Namespace):
    """Each tree given on the command line, also as its ``NANFUZZ_*_SRC`` variable while the command runs.

    A user's adapter module (``package.module:attr``) can only learn where a library lives from the
    environment; ``--aiter-src DIR`` then reaches it as ``NANFUZZ_AITER_SRC=DIR`` would, in this
    process and in every process the run starts.  Entered before the fork server starts, which keeps
    the environment it started with.  The path is made absolute, as a process may run elsewhere.
    """
    before = {}
    for keyword, _ in SOURCES.values():
        given = getattr(args, keyword, None)
        if given:
            name = environment_variable(keyword)
            before[name] = os.environ.get(name)
            os.environ[name] = str(Path(given).expanduser().resolve())
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
