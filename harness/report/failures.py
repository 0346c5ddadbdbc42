"""Reporting a failure so that it is never lost: the repro on disk, or the finding in full on screen."""
from __future__ import annotations

import json
import sys

from nanfuzz.harness.report.picture import picture
from nanfuzz.harness.report.repro import repro_record, write_repro


def report_failure(kernel, campaign, settings, stream=None) -> list[str]:
    """Write the campaign's repro and print where; if it cannot be written, print all of it.

    Returns the paths written (empty when the repro went to the screen instead).
    """
    stream = stream or sys.stdout
    case, outcome = campaign.failing_case, campaign.failure
    try:
        paths = [str(p) for p in write_repro(kernel, case, outcome, settings.repro_dir, settings.device)]
    except OSError as exc:
        print(f"nanfuzz: cannot write the repro to {str(settings.repro_dir)!r} ({exc.strerror or exc}); "
              "the finding follows in full", file=sys.stderr, flush=True)
        record = repro_record(kernel, case, outcome, settings.device)
        stream.write(f"\n{kernel.name}: {outcome.summary}\n{picture(case)}\n"
                     f"repro JSON (save it and run `nanfuzz replay FILE.json`):\n{json.dumps(record, indent=1)}\n\n")
        stream.flush()
        campaign.repro_paths = []
        return []
    campaign.repro_paths = paths
    from nanfuzz.harness.registry import source_option

    source = source_option(kernel)
    stream.write(f"\n{kernel.name}: {outcome.summary}\n{picture(case)}\n"
                 f"repro: {paths[0]}\nreplay: nanfuzz replay {paths[0]}{source}\n\n")
    stream.flush()
    return paths


def print_notes(campaign, stream=None) -> None:
    for note in campaign.notes:
        print(f"nanfuzz: {note}", file=stream or sys.stderr, flush=True)
