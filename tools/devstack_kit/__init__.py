"""The parts of ``tools/devstack.py`` (``make run``), one job a module.

``plan``: the stack's processes and what each will run with; ``fleet``: the fleet file the
control-plane reads and the providers "up" waits for; ``preflight``: what is checked
before anything starts; ``processes``: one child, its output and its restarts' backoff;
``health``: readiness and the providers' availability, polled; ``supervisor``: the
children in start order, kept running, stopped in reverse. ``tools/devstack.py`` is the
command line over them.
"""
