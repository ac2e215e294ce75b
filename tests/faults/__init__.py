"""Fault-injection suite: real Redis nodes, many client processes, a history checker and a
fencing oracle (see docs/faults.rst).

* :mod:`.history`: hold records and the offline overlap check;
* :mod:`.oracle`: the fenced resource (rejects stale fences at write time);
* :mod:`.proxy`: a TCP proxy that delays replies or resets connections after a request;
* :mod:`.harness`: nodes + oracle + client processes + controller;
* :mod:`.scenarios`: the scenarios, ``SCENARIOS``;
* :mod:`.report`: the results table; ``python -m tests.faults [--soak] [--table]``;
* :mod:`.plugin`: the ``--soak`` pytest option.
"""
