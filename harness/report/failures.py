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
    except Exception as exc:  # a folder that cannot be written, or anything else: the finding is never lost
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        print(f"nanfuzz: cannot write the repro to {str(settings.repro_dir)!r} ({why}); "
              "the finding follows in full", file=sys.stderr, flush=True)
        try:
            record = repro_record(kernel, case, outcome, settings.device)
        except Exception:  # the record's extras (environment, module origin) are what failed: the essentials
            record = {"kernel": getattr(kernel, "name", str(kernel)), "case": case.to_dict(), **outcome.to_dict()}
        stream.write(f"\n{getattr(kernel, 'name', kernel)}: {outcome.summary}\n{picture(case)}\n"
                     f"repro JSON (save it and run `nanfuzz replay FILE.json`):\n"
                     f"{json.dumps(record, indent=1, default=str)}\n\n")
        stream.flush()
        campaign.repro_paths = []
        return []
    campaign.repro_paths = paths
    from nanfuzz.harness.registry import source_option

    source = source_option(kernel, settings.sources)
    stream.write(f"\n{kernel.name}: {outcome.summary}\n{picture(case)}\n"
                 f"repro: {paths[0]}\nreplay: nanfuzz replay {paths[0]}{source}\n\n")
    stream.flush()
    return paths


def print_notes(campaign, stream=None) -> None:
    for note in campaign.notes:
        print(f"nanfuzz: {note}", file=stream or sys.stderr, flush=True)
