"""Every verdict fires on the defect it names, and a correct kernel passes."""
import pytest
import torch

from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from tests.torch_kernels import torch_kernel

G = Geometry(4, 2, 32, 8, 8, "float32")
# seq 0: decode at position 19, window 6 -> keys 14..19 live; seq 1: chunked prefill
WINDOWED = Case(G, (Sequence(1, 20, (1, 2, 3)), Sequence(3, 11, (4, 5, 7))), sliding_window=6,
                padding_block=7, poison=Poison("nan", "kv", None), data_seed=5).validate()


@pytest.mark.parametrize("bug, verdict", [
    (None, Verdict.PASS),
    ("raise", Verdict.CRASH),
    ("mask-multiply", Verdict.NONFINITE),
    ("window-off-by-one", Verdict.MISMATCH),
    ("head-map", Verdict.MISMATCH),
    ("clobber", Verdict.CLOBBER),
    ("clobber-input", Verdict.CLOBBER),
])
def test_verdicts(bug, verdict):
    outcome = check(torch_kernel(bug), WINDOWED, "cpu")
    assert outcome.verdict is verdict, outcome.summary
    assert "\n" not in outcome.summary


def test_leak_is_found_with_finite_poison_only():
    finite = WINDOWED.replace(poison=Poison("garbage", "k", None))
    outcome = check(torch_kernel("additive-mask"), finite, "cpu")
    assert outcome.verdict in (Verdict.LEAK, Verdict.NONFINITE), outcome.summary
    quiet = WINDOWED.replace(poison=Poison("garbage", "v", (PoisonSite(6, 0),)))
    assert check(torch_kernel("additive-mask"), quiet, "cpu").verdict is Verdict.LEAK


def test_nonfinite_evidence_names_rows_and_reachable_poison():
    tail_only = WINDOWED.replace(poison=Poison("nan", "v", (PoisonSite(3, 4),)))  # seq 0: key 20, the tail
    outcome = check(torch_kernel("mask-multiply"), tail_only, "cpu")
    assert outcome.verdict is Verdict.NONFINITE
    assert outcome.evidence["sequences"] == [0]
    assert outcome.evidence["reachable_poison"]["0"] == {"tail": [[3, 4, 4]]}
    assert "tail" in outcome.summary


def test_correct_kernel_output_is_reproducible_bit_for_bit():
    a = check(torch_kernel(), WINDOWED, "cpu")
    b = check(torch_kernel(), WINDOWED, "cpu")
    assert a.verdict is Verdict.PASS and a.output_sha256 == b.output_sha256


def _counting(act):
    """The correct kernel; ``act(n, out)`` runs after its n-th launch (0: the poisoned run,
    1: the repeat on identical inputs, 2: the finite-garbage run)."""
    from nanfuzz.harness.kernel import Kernel
    from tests.torch_kernels import CAPS, attention

    launches = [0]

    def run(batch, out):
        attention(batch, out)
        act(launches[0], out)
        launches[0] += 1
        return out
    return Kernel(name="torch@counting", run=run, capabilities=CAPS)


def _raise_on_garbage_run(n, out):
    if n == 2:
        raise RuntimeError("planted failure on the third launch")


def _unstable_then_raise(n, out):
    if n == 1:
        out.view(-1)[:1].view(torch.int32).add_(1)  # one unit in the last place, on the repeat only
    _raise_on_garbage_run(n, out)


def test_a_crash_on_the_garbage_run_is_a_crash_unless_the_repeat_already_differed():
    crash = check(_counting(_raise_on_garbage_run), WINDOWED, "cpu")
    assert crash.verdict is Verdict.CRASH and "finite-garbage run" in crash.summary, crash.summary
    unstable = check(_counting(_unstable_then_raise), WINDOWED, "cpu")
    assert unstable.verdict is Verdict.NONDETERMINISTIC, unstable.summary


def _write_into_padding(batch, out):
    """The correct kernel, plus one byte flipped in the padding after an allocation: inside the
    batch's one buffer, outside every input and redzone."""
    from tests.torch_kernels import attention

    attention(batch, out)
    buffer = torch.empty(0, dtype=torch.uint8).set_(batch.q.untyped_storage())
    ends = [base.data_ptr() - buffer.data_ptr() + base.numel() * base.element_size() for base in batch.bases().values()]
    buffer[next(end for end in sorted(ends) if end % 256)] ^= 1
    return out


def test_a_write_between_the_inputs_allocations_is_a_clobber_and_named_so():
    from nanfuzz.harness.kernel import Kernel
    from tests.torch_kernels import CAPS

    outcome = check(Kernel(name="torch@pads", run=_write_into_padding, capabilities=CAPS), WINDOWED, "cpu")
    assert outcome.verdict is Verdict.CLOBBER
    assert outcome.evidence["written"] == ["the memory between its inputs' allocations"], outcome.summary
    named = check(torch_kernel("clobber-input"), WINDOWED, "cpu")
    assert "value_cache" in named.summary and "between" not in named.summary, named.summary


def test_a_device_fault_met_by_the_oracle_is_the_poisoned_runs_crash_and_our_own_errors_are_not(monkeypatch):
    # on a GPU the host first waits for the poisoned run wherever the oracle first needs the device
    from nanfuzz.harness.judge import check as checking

    def faulting_oracle(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(checking, "attend_and_measure", faulting_oracle)
    outcome = check(torch_kernel(), WINDOWED, "cpu")
    assert outcome.verdict is Verdict.CRASH and outcome.fatal
    assert outcome.summary.startswith("CRASH on the poisoned run: RuntimeError: CUDA error: an illegal memory")

    def broken_oracle(*args, **kwargs):
        raise ValueError("a bug of the oracle's own")

    monkeypatch.setattr(checking, "attend_and_measure", broken_oracle)
    with pytest.raises(ValueError, match="oracle's own"):  # never blamed on the kernel
        check(torch_kernel(), WINDOWED, "cpu")


def test_an_oracle_error_after_a_faulted_run_reports_the_fault_and_without_one_is_our_own(monkeypatch):
    # a fault that killed the context before cuBLAS was set up reaches the oracle as cuBLAS's own error
    from nanfuzz.harness.judge import check as checking

    def oracle_on_a_dead_context(*args, **kwargs):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`")

    monkeypatch.setattr(checking, "attend_and_measure", oracle_on_a_dead_context)
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_INITIALIZED"):  # the run itself was fine
        check(torch_kernel(), WINDOWED, "cpu")

    def run_that_faulted(device, events, when):  # what waiting for a faulted GPU run gives
        return checking._crash(RuntimeError("CUDA error: an illegal memory access was encountered"), when)

    monkeypatch.setattr(checking, "_await_runs", run_that_faulted)
    outcome = check(torch_kernel(), WINDOWED, "cpu")
    assert outcome.verdict is Verdict.CRASH and outcome.fatal
    assert outcome.summary.startswith("CRASH on the poisoned run: RuntimeError: CUDA error: an illegal memory")


def test_a_compile_error_s_crash_names_the_kernel_s_line_and_the_cause():
    """Triton's CompilationError begins with only "at LINE:COL:"; the CRASH says what failed and where."""
    import ast

    from triton.compiler.errors import CompilationError

    from nanfuzz.harness.judge.outcome import crash, one_line

    source = "def kernel(x):\n    offs = tl.arange(0, TILE_SIZE)\n    return offs\n"
    node = ast.parse(source).body[0].body[0].value
    error = CompilationError(source, node, repr(ValueError("arange's range must be a power of 2")))
    summary = crash(error, "on the poisoned run").summary
    assert summary == ("CRASH on the poisoned run: CompilationError: at 2:11 in `offs = tl.arange(0, TILE_SIZE)`: "
                       "ValueError(\"arange's range must be a power of 2\")")
    assert one_line(RuntimeError("first line\nsecond line")) == "RuntimeError: first line"
    assert one_line(KeyError()) == "KeyError"


def test_a_crash_s_traceback_names_files_without_this_machine_s_folders():
    """A repro is a file users commit and share: its traceback names nanfuzz's files from nanfuzz's
    root, installed packages from site-packages/ and the rest of the home folder as ~/."""
    from pathlib import Path

    from nanfuzz.harness.judge.outcome import portable_path

    crash = check(torch_kernel("raise"), WINDOWED, "cpu")
    assert crash.verdict is Verdict.CRASH
    root = str(Path(__file__).resolve().parents[1])
    files = [line.strip() for line in crash.evidence["traceback"].splitlines() if line.strip().startswith("File ")]
    assert files and not any(root in line for line in files), files
    assert any('"tests/torch_kernels.py"' in line for line in files), files
    assert portable_path("/usr/lib/python3/site-packages/triton/runtime/jit.py") == "site-packages/triton/runtime/jit.py"
    assert portable_path(str(Path.home() / ".cache" / "k.py")) == "~/.cache/k.py"
    assert portable_path("/srv/elsewhere/k.py") == "/srv/elsewhere/k.py"


def test_a_ctrl_c_while_waiting_for_the_device_stops_the_check_and_a_fault_there_is_its_crash(monkeypatch):
    """Under ``--no-isolation`` the search's own thread waits for the GPU: a Ctrl-C (or a stop
    signal's ``StopRequested``) that lands in that wait ends the campaign, never a CRASH of the case."""
    from types import SimpleNamespace

    from nanfuzz.harness.campaign.search import StopRequested
    from nanfuzz.harness.judge import runs

    gpu = SimpleNamespace(type="cuda")
    for stop in (KeyboardInterrupt, StopRequested):
        def interrupted(device, stop=stop):
            raise stop()

        monkeypatch.setattr(runs, "sync", interrupted)
        with pytest.raises(stop):
            runs.await_runs(gpu, runs.no_events, "on the poisoned run")

    def faulted(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(runs, "sync", faulted)
    outcome = runs.await_runs(gpu, runs.no_events, "on the poisoned run")
    assert outcome.verdict is Verdict.CRASH and outcome.fatal
    assert outcome.summary.startswith("CRASH on the poisoned run: RuntimeError: CUDA error: an illegal memory")


@pytest.mark.parametrize("bug, verdict", [
    (None, Verdict.PASS),
    ("mask-multiply", Verdict.NONFINITE),
    ("window-off-by-one", Verdict.MISMATCH),
    ("head-map", Verdict.MISMATCH),
])
def test_an_oracle_on_the_host_batch_judges_as_one_on_the_device(monkeypatch, bug, verdict):
    """On a GPU a small case's oracle attends on the host build (``CaseCheck._oracle_on_host``); forced
    so here, it reads the host batch, never the device's, and every figure of the verdict is the same."""
    from nanfuzz.harness.judge import check as judge

    on_device = check(torch_kernel(bug), WINDOWED, "cpu")
    attended = []
    real = judge.attend_and_measure
    monkeypatch.setattr(judge, "attend_and_measure", lambda batch, *a, **k: attended.append(batch) or real(batch, *a, **k))
    monkeypatch.setattr(judge.CaseCheck, "_oracle_on_host", lambda self: self.host is not None)
    hosts = []
    build = judge.CaseCheck._build
    monkeypatch.setattr(judge.CaseCheck, "_build", lambda self: (build(self), hosts.append(self.host))[0])
    on_host = check(torch_kernel(bug), WINDOWED, "cpu")
    assert attended and attended[0] is hosts[0]
    assert on_host.verdict is on_device.verdict is verdict, on_host.summary
    assert on_host.summary == on_device.summary
    assert on_host.evidence == on_device.evidence


def test_only_a_small_case_on_a_gpu_has_its_oracle_on_the_host():
    from nanfuzz.harness.judge.check import HOST_ORACLE_PRODUCTS, CaseCheck, LargeCaseCheck
    from nanfuzz.reference.oracle import padded_products

    def judge(kind, case, device):
        return kind(torch_kernel(None), case, torch.device(device), False, lambda *a: None)

    assert padded_products(WINDOWED) <= HOST_ORACLE_PRODUCTS
    assert judge(CaseCheck, WINDOWED, "cuda")._oracle_on_host()
    assert not judge(CaseCheck, WINDOWED, "cpu")._oracle_on_host()  # there the device's batch is the host's
    assert not judge(LargeCaseCheck, WINDOWED, "cuda")._oracle_on_host()
    per_seq = 32  # blocks of 8 keys: 256 keys a sequence
    long = Case(Geometry(16, 2, 128, 8, 1 + 8 * per_seq, "float16"),
                tuple(Sequence(1, 256, tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq))) for s in range(8)),
                data_seed=1).validate()
    assert padded_products(long) > HOST_ORACLE_PRODUCTS
    assert not judge(CaseCheck, long, "cuda")._oracle_on_host()
