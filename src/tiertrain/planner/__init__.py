"""The planner: profiles (data), the simulator and the solvers. Pure: no torch, no runtime, no
memory machinery, so it plans from a profile file for any machine."""
