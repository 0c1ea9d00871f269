"""Everything tiertrain measures, in one place: the disk (``disk``), the page size (``page_size``),
the machine's speeds (``machine``), a model's blocks run for real (``model``, ``one_block``) or
estimated from its shape (``analytic``), and the one cache they share (``cache``).

The planner reads what this produces (a ``Profile``) and measures nothing itself.
"""
