"""minifsdp.labcheck: the labs' check functions, one module per lab (lab05_runs.py: the workers lab05 launches).

A check cell in a notebook is one call that runs the learner's code, compares
it with the single-process computation and with the library, and prints one
line: passed (with the learner's figure beside the target), or what is wrong,
in words (``../shared/LAB-GUIDE.md`` §2)::

    from minifsdp.labcheck import lab00 as check
    check.ring_all_gather(ring_all_gather)

Read ``verdict.py`` first (how a verdict is printed and how a check tells the
learner's code from the library's), then the module of the lab you teach.
This is the front layer: it may import any technique; nothing imports it.
"""
