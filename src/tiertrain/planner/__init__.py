"""The planner: profiles (data), the simulator and the solvers. Pure: no torch, no runtime, no
memory machinery, so it plans from a profile file for any machine. ``machine`` describes a machine
(``datasheets`` holds built-in ones), and ``retarget`` carries a profile to a described machine."""
