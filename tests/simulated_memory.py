"""The ``nanfuzz`` command on a simulated device: ``python -m tests.simulated_memory LEDGER TOTAL_GIB
CASE_GIB [nanfuzz arguments...]``.

Every campaign started this way with the same LEDGER folder shares one device of TOTAL_GIB whose
every case needs CASE_GIB (``harness.judge.memory.SimulatedDevice``): separate commands on one
GPU, as a CI machine runs them, without a GPU.
"""
from __future__ import annotations

import sys

from nanfuzz.harness.judge.memory import GiB, MemoryPolicy, SimulatedDevice


def main(argv: list[str]) -> int:
    ledger, total, case, *command = argv
    from nanfuzz.harness.campaign.settings import Settings

    policy = MemoryPolicy(ledger_dir=ledger, simulated=SimulatedDevice(int(float(total) * GiB), int(float(case) * GiB)))
    made = Settings.from_environment.__func__

    def from_environment(cls, environ=None, **options):
        return made(cls, environ, **options).replace(memory=policy)

    Settings.from_environment = classmethod(from_environment)
    from nanfuzz.harness.cli import main as nanfuzz

    return nanfuzz(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
