"""The PR gate, ``nanfuzz gate``: a runner's campaigns on every GPU, their reports, and a fleet's merge.

``run`` is the command (plan, workers, reports); ``devices`` finds the
workers, ``plan`` is what every worker reads and the records it writes,
``campaigns`` the pytest module each worker runs, ``shard`` one kernel's
campaign in a worker, ``report`` the summary and JUnit built from the records,
``outputs`` writes them, and ``merge`` is ``nanfuzz gate merge``.
"""
