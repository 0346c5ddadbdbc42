"""A bug of nanfuzz's own judging code is never the kernel's CRASH: one line naming nanfuzz's file
and line, as a usage error (exit 2 before a finding, a note after one)."""
from __future__ import annotations

import functools

import pytest

from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge import check as judge
from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.judge.own_fault import own_fault
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.launch.worker import InProcess, Supervised
from nanfuzz.reference.errors import NanfuzzError
from tests import subjects
from tests.cases import consecutive_case

CASE = consecutive_case([(1, 20)])
PASSES = subjects.runs_out_of_memory  # correct on a case with no window
# raises AttributeError from C code: the innermost frame is nanfuzz's, where it is called
BROKEN_RELEASE = functools.partial(getattr, object(), "_clean")


def _raised(function) -> BaseException:
    try:
        function()
    except BaseException as exc:  # noqa: BLE001 - the exception is the subject
        return exc
    raise AssertionError("nothing raised")


def test_only_a_programming_error_raised_in_nanfuzz_s_own_files_is_its_fault():
    from nanfuzz.reference.case import Case

    ours = _raised(lambda: Case.from_json(None))  # a TypeError/AttributeError inside nanfuzz's reference
    assert not own_fault(ours)  # a frame of this test's own (the lambda) is on the way
    inner = ours.__traceback__.tb_next.tb_next  # from nanfuzz's first frame down (past _raised and the lambda)
    assert own_fault(ours.with_traceback(inner)).startswith("nanfuzz's own error while judging this case")
    assert "reference/case.py:" in own_fault(ours.with_traceback(inner))
    assert not own_fault(_raised(lambda: object().missing))  # nothing of nanfuzz's
    assert not own_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_a_bug_in_the_judge_in_process_is_one_usage_error_not_a_crash(monkeypatch):
    monkeypatch.setattr(judge.CaseCheck, "_release", BROKEN_RELEASE)
    subject = InProcess(PASSES, "cpu")
    try:
        with pytest.raises(NanfuzzError, match=r"nanfuzz's own error .* AttributeError: .* at harness/judge/check.py:"):
            subject.check(CASE)
    finally:
        subject.close()


def test_a_bug_in_the_judge_in_a_worker_is_one_usage_error_not_a_crash(monkeypatch):
    monkeypatch.setattr(judge.CaseCheck, "_release", BROKEN_RELEASE)
    subject = Supervised(worker_spec(PASSES, Settings(device="cpu")), launch_timeout=30.0, prefer_fork=True)
    try:
        with pytest.raises(NanfuzzError, match=r"nanfuzz's own error .* at harness/judge/check.py:"):
            subject.check(CASE)
    finally:
        subject.close()
    monkeypatch.undo()
    subject = Supervised(worker_spec(PASSES, Settings(device="cpu")), launch_timeout=30.0, prefer_fork=True)
    try:
        assert subject.check(CASE).verdict is Verdict.PASS
    finally:
        subject.close()
