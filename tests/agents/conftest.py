"""The coding agents' suite (``make test-agents``): ``make run``'s own stack, once for the
module, and each agent pointed at it through a recording relay.

Plain ``make test`` runs these where ``make agents`` has installed the agents and skips
them, naming ``make agents``, where it has not; ``make test-agents`` sets
``TEST_AGENTS_REQUIRED=1``, which turns that absence into a failure.
"""
