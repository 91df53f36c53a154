"""IOP benchmarks: gateway overhead, streaming, selection and queue scale, a real model.

Run with ``make bench`` (quick), ``make bench-full`` or ``tools/bench/run.py --tiny``
(the CI smoke run). Each scenario is a module of its own; ``run.py`` strings them
together and writes one JSON document. See README.md in this folder.
"""
