"""Small pure-torch kernels with planted bugs: they exercise every verdict without Triton."""
from __future__ import annotations

import torch

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.materialize import token_layout

# specialisation_pool=0: plain torch compiles nothing per case, so a GPU campaign draws freely
CAPS = Capabilities(non_causal=True, sinks=True, interpreter_dtypes=("float16", "bfloat16", "float32"), precision="ieee",
                    specialisation_pool=0)


def attention(batch, out, *, bug: str | None = None, scale_factor: float = 1.0, operand_rounding=None):
    """Dense attention over every slot of each sequence's table, masking scores.

    ``bug`` plants one defect: "mask-multiply" (p = 0 times unmasked V: NaN leaks),
    "additive-mask" (scores get -1e4 instead of -inf: garbage K leaks), "window-off-by-one",
    "head-map" (GQA heads mapped modulo instead of by group), "clobber" (writes a guard row),
    "clobber-input" (writes into the value cache), "raise", "drop-key" (a query that may
    read several keys skips the first of them).  ``scale_factor`` multiplies the softmax scale;
    ``operand_rounding`` rounds q, K, V and P before their products (e.g. to TF32).
    """
    rounding = operand_rounding or (lambda x: x)
    if bug == "raise":
        raise RuntimeError("planted launch failure")
    case = batch.case
    g = case.geometry
    seq_of, pos_of = token_layout(case)
    width = batch.block_table.shape[1] * g.block_size
    keys = torch.arange(width, device=batch.q.device)
    for t, (s, p) in enumerate(zip(seq_of, pos_of)):
        seq = case.sequences[s]
        slots = batch.block_table[s].long()[keys // g.block_size] * g.block_size + keys % g.block_size
        k = rounding(batch.key_cache.reshape(-1, g.num_kv_heads, g.head_size)[slots].float())
        v = rounding(batch.value_cache.reshape(-1, g.num_kv_heads, g.v_head_size)[slots].float())
        ok = keys < seq.seq_len
        if case.causal:
            ok &= keys <= p
        if case.sliding_window:
            window = case.sliding_window - (1 if bug == "window-off-by-one" else 0)
            dist = (p - keys) if case.causal else (p - keys).abs()
            ok &= dist < window
        if bug == "drop-key" and int(ok.sum()) > 1:
            ok[int(ok.nonzero()[0])] = False
        if bug not in ("mask-multiply", "additive-mask"):
            k = torch.where(ok[:, None, None], k, 0.0)
            v = torch.where(ok[:, None, None], v, 0.0)
        for h in range(g.num_q_heads):
            kv = h % g.num_kv_heads if bug == "head-map" else h // g.queries_per_kv
            scores = (k[:, kv] @ rounding(batch.q[t, h].float())) * (case.scale * scale_factor)
            if bug == "additive-mask":
                scores = scores + torch.where(ok, 0.0, -1e4)
            else:
                scores = torch.where(ok, scores, float("-inf"))
            m = scores.max()
            if batch.sinks is not None:
                m = torch.maximum(m, batch.sinks[h])
            p_ = torch.exp(scores - m)
            denom = p_.sum() + (torch.exp(batch.sinks[h] - m) if batch.sinks is not None else 0.0)
            out[t, h] = ((rounding(p_) @ v[:, kv]) / denom).to(out.dtype)
    if bug == "clobber":
        base = out.as_strided((out.shape[0] + 1, *out.shape[1:]), out.stride())
        base[-1].zero_()
    if bug == "clobber-input":
        batch.value_cache[0, 0].zero_()
    return out


BUGS = (None, "mask-multiply", "additive-mask", "window-off-by-one", "head-map", "clobber", "clobber-input", "raise")


def _make(bug: str | None) -> Kernel:
    attr = (bug or "correct").replace("-", "_")
    return Kernel(name=f"torch@{bug or 'correct'}", run=lambda b, o: attention(b, o, bug=bug), capabilities=CAPS,
                  expect="caught" if bug else "pass", spec=f"tests.torch_kernels:{attr}")


# One Kernel object per bug at an import path, so a worker process can rebuild it
# ("tests.torch_kernels:mask_multiply").
_KERNELS = {bug: _make(bug) for bug in BUGS}
globals().update({(bug or "correct").replace("-", "_"): kernel for bug, kernel in _KERNELS.items()})


def torch_kernel(bug: str | None = None) -> Kernel:
    return _KERNELS[bug]


def _die_on_windows(batch, out):
    import os

    if batch.case.sliding_window:
        os._exit(70)  # as a GPU fault would end the process
    return attention(batch, out)


dies_on_windows = Kernel(name="torch@dies-on-windows", run=_die_on_windows, capabilities=CAPS, expect="caught",
                         spec="tests.torch_kernels:dies_on_windows")


def _note_parent(batch, out):
    """Correct, and notes (in ``parents.txt`` in the current folder) this worker's pid and its ancestors'."""
    import os

    chain = [os.getpid()]
    for _ in range(4):
        try:
            with open(f"/proc/{chain[-1]}/stat") as f:
                chain.append(int(f.read().rsplit(")", 1)[1].split()[1]))
        except (OSError, ValueError, IndexError):
            break
    with open("parents.txt", "a") as f:
        f.write(" ".join(map(str, chain)) + "\n")
    return attention(batch, out)


notes_parent = Kernel(name="torch@notes-parent", run=_note_parent, capabilities=CAPS, spec="tests.torch_kernels:notes_parent")


def _burns_cpu(batch, out):
    """Correct, after 30 ms of spinning the host's CPU (a launch that keeps the host busy)."""
    import time

    until = time.process_time() + 0.03
    while time.process_time() < until:
        pass
    return attention(batch, out)


def _sleeps(batch, out):
    """Correct, after 30 ms asleep (a launch the host only waits for)."""
    import time

    time.sleep(0.03)
    return attention(batch, out)


burns_cpu = Kernel(name="torch@burns-cpu", run=_burns_cpu, capabilities=CAPS, spec="tests.torch_kernels:burns_cpu")
sleeps = Kernel(name="torch@sleeps", run=_sleeps, capabilities=CAPS, spec="tests.torch_kernels:sleeps")


def _correct_in_a_forked_worker(batch, out):
    """Correct only in a worker forked from the process that started it; anywhere else (a worker
    from a fork server, or no worker at all) it writes NaN into every output row."""
    import multiprocessing
    import os

    starter = multiprocessing.parent_process()
    if starter is None or os.getppid() != starter.pid:
        return out.fill_(float("nan"))
    return attention(batch, out)


correct_in_a_forked_worker = Kernel(name="torch@correct-in-a-forked-worker", run=_correct_in_a_forked_worker,
                                    capabilities=CAPS, spec="tests.torch_kernels:correct_in_a_forked_worker")


# The GPU's fp8 skips a test's run tells the processes it starts (``encodings.told_gpu_skips``)
TOLD_GPU_SKIPS = (("fp8_e4m3fnuz", "told by the run that started this process"),)


def _correct_where_told_the_gpu_skips(batch, out):
    """Correct only in a process told that the GPU's fp8 skips are ``TOLD_GPU_SKIPS`` (a worker forked
    from a campaign's or a job's process knows what that process was told); elsewhere NaN rows."""
    from nanfuzz.harness.judge import encodings

    if encodings._known_gpu_skips != [TOLD_GPU_SKIPS]:
        return out.fill_(float("nan"))
    return attention(batch, out)


correct_where_told_the_gpu_skips = Kernel(name="torch@correct-where-told-the-gpu-skips",
                                          run=_correct_where_told_the_gpu_skips, capabilities=CAPS,
                                          spec="tests.torch_kernels:correct_where_told_the_gpu_skips")
