"""Everything tiertrain measures, in one place: the disk (``disk``), the page size (``page_size``),
this machine's description (``machine``, with the load it was probed under: ``load``), a model's
blocks run for real (``model``, ``one_block``) within what a measurement may take (``bounds``) or
estimated from its shape (``analytic``), and the one cache they share (``cache``).

The planner reads what this produces (a ``Profile``) and measures nothing itself.
"""
