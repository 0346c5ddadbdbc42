"""What the fork server's children start with: Ctrl-C ignored.

The fork server imports this module first, as a preload (``processes.fork_server_context``),
and nothing else imports it.  Each process the server forks restores the handlers the
server had before it took Ctrl-C away from itself, and those are set here: so a Ctrl-C
to the campaign's process group that reaches a child between its fork and its own first
act is ignored, where Python's default handler would raise in ``multiprocessing``'s
start-up, before the child's code could catch it, with a traceback.  Each child's main
decides from there: a worker or a farm process keeps it ignored (``isolation.isolate``), a
job or a side-by-side campaign installs its own handler and then says it listens (a job
not listening yet meets the interrupt event instead).
"""
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
