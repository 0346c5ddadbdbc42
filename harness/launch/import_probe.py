"""A user's adapter module, imported first in a process of its own.

``--kernel mypkg.adapter:kernel`` runs the user's code as its module is
imported.  In the campaign's own process, a module that calls ``sys.exit(0)``
there would end the command with "no failure", ``sys.exit("msg")`` with "a
finding", and a segfault or a hang would be raw or unbounded.  So the module is
imported first in an isolated process (a session of its own, as a worker's),
within the launch timeout: any way that import ends other than with a Kernel at
the named attribute is one line naming the module, exit 2.  Only then does the
campaign import it itself (``load_kernel``).
"""
from __future__ import annotations

import os
import signal
import tempfile
from multiprocessing.connection import wait

from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.isolation import end_group, isolate
from nanfuzz.harness.launch.processes import fork_server_context, interpret_if_cpu, start
from nanfuzz.harness.registry import is_user_spec, resolve
from nanfuzz.reference.errors import NanfuzzError


def load_kernel(name: str, settings) -> Kernel:
    """``resolve(name)`` in this process, a user's module imported first in a probe process
    (``settings``: the campaign's).  With ``isolation=False`` too: launches in this process are
    for debugging, but an import that never ends must still end the command."""
    if is_user_spec(name):
        import_first(name, settings.device, settings.timeout, settings.import_root)
    return resolve(name, **settings.sources)


def import_first(name: str, device: str, timeout: float, import_root: str | None = None,
                 timeout_source: str = "the launch timeout, --launch-timeout") -> None:
    """Import the module of the user's kernel ``name`` in a probe process (``import_root``: see
    ``resolve``); a NanfuzzError unless it gives a Kernel within ``timeout`` seconds
    (``timeout_source`` says where that number comes from)."""
    module = name.partition(":")[0]
    fd, log = tempfile.mkstemp(prefix="nanfuzz-import-", suffix=".log")
    os.close(fd)
    context = fork_server_context()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_probe, args=(sender, name, device, log, import_root), daemon=True,
                              name="nanfuzz-import")
    try:
        try:
            start(process, context.get_start_method() == "forkserver")
        finally:
            sender.close()
        ready = wait([receiver, process.sentinel], timeout=timeout)
        answer = _receive(receiver) if receiver in ready else None
        if answer is None:
            how = (_death(process) if ready else
                   f"did not finish within {timeout:g} s ({timeout_source})")
            printed = _last_line(log)
            raise NanfuzzError(f"kernel {name!r}: importing module {module!r} {how}"
                               + (f"; it printed: {printed}" if printed else ""))
        if answer[0] != "kernel":
            raise NanfuzzError(answer[1])
    finally:
        if process.pid is not None:  # None: it never started
            end_group(process.pid)
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        receiver.close()
        os.unlink(log)


def _probe(sender, name: str, device: str, log: str, import_root: str | None) -> None:
    isolate()
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    interpret_if_cpu(device)  # before the module defines any @triton.jit function
    try:
        answer = ("kernel", resolve(name, import_root=import_root).name)
    except NanfuzzError as exc:
        answer = ("error", str(exc))
    except BaseException as exc:  # KeyboardInterrupt (resolve takes SystemExit): any way an import may end
        text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        answer = ("error", f"kernel {name!r}: cannot import module {name.partition(':')[0]!r} ({text})")
    sender.send(answer)
    sender.close()


def _receive(receiver):
    try:
        return receiver.recv()
    except (EOFError, OSError):
        return None


def _death(process) -> str:
    process.join(timeout=5)
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"killed its process ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed its process (signal {-code})"
    return f"ended its process (exit status {code})"


def _last_line(log: str) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""
