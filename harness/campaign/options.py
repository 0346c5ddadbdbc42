"""A campaign's options by keyword, as ``nanfuzz.fuzz(kernel, **options)`` and the pytest fixture's
``nanfuzz.fuzz(kernel, **options)`` take them: the command line's options, named as Python names.

Two kinds, one namespace:

- where the campaign runs and how long (``Settings`` fields): ``max_examples``, ``seed``,
  ``time_budget``, ``profile``, ``size``, ``jobs``, ``shrink``, ``repro_dir``, ``state_dir``,
  ``example_db``, ``launch_timeout``, ``isolation``, ``strict_reads``, ``targeting``,
  ``pool_size``, ``compile_jobs``, the library trees ``vllm_src`` ... ``lmdeploy_src``, and the
  rest of ``Settings``;
- which cases it draws (``Focus`` fields): ``decode_only``, ``prefill_only``, ``no_window``,
  ``window_only``, ``causal_only``, ``non_causal_only``, ``dtype``, ``kv_cache_dtype``,
  ``kv_scales``, and ``poison`` (one dead-slot class or several, the command line's
  ``--poison``; ``poison_classes`` is the same).  ``focus=Focus(...)`` is taken too; a keyword
  given beside it wins.

An unknown keyword is one ``NanfuzzError`` that names it and every known one.
"""
from __future__ import annotations

import dataclasses
import difflib

from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.features import POISON_CLASS_NAMES

# ``device`` is fuzz()'s own parameter; ``focus`` is taken whole or by its fields.
SETTINGS_KEYWORDS = tuple(f.name for f in dataclasses.fields(Settings) if f.name != "device")
FOCUS_KEYWORDS = (*(f.name for f in dataclasses.fields(Focus)), "poison")
KEYWORDS = tuple(sorted({*SETTINGS_KEYWORDS, *FOCUS_KEYWORDS}))


def split_options(options: dict, where: str = "nanfuzz.fuzz()") -> dict:
    """``options`` as ``Settings`` fields, the ``Focus`` keywords folded into ``focus``; an unknown
    keyword or a poison class that does not exist is a ``NanfuzzError`` naming ``where``."""
    unknown = sorted(set(options) - set(KEYWORDS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], KEYWORDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise NanfuzzError(f"{where} takes no option {unknown[0]!r}{hint}; known: {', '.join(KEYWORDS)}")
    settings = {name: value for name, value in options.items() if name in SETTINGS_KEYWORDS}
    focus_fields = {name: value for name, value in options.items() if name in FOCUS_KEYWORDS and name != "focus"}
    if "poison" in focus_fields:
        if "poison_classes" in focus_fields:
            raise NanfuzzError(f"{where}: poison= and poison_classes= say the same; give one")
        focus_fields["poison_classes"] = focus_fields.pop("poison")
    if focus_fields.get("poison_classes") is not None:
        focus_fields["poison_classes"] = _poison_classes(focus_fields["poison_classes"], where)
    if focus_fields:
        base = settings.get("focus") or Focus()
        if not isinstance(base, Focus):
            raise NanfuzzError(f"{where}: focus={base!r} is not a nanfuzz Focus; give its fields as keywords "
                               "(window_only=True, poison='tail', ...)")
        settings["focus"] = dataclasses.replace(base, **focus_fields)
    return settings


def _poison_classes(value, where: str) -> tuple[str, ...]:
    classes = (value,) if isinstance(value, str) else tuple(value)
    wrong = [c for c in classes if c not in POISON_CLASS_NAMES]
    if wrong or not classes:
        raise NanfuzzError(f"{where}: poison={value!r} is not a dead-slot class or a list of them; "
                           f"known: {', '.join(POISON_CLASS_NAMES)}")
    return classes
