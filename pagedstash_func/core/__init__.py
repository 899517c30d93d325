"""The floor of the library: the config, the frame a step opens, and the integer side of
routing (padding ids, capacity formulas). Imports nothing of the library but `kernels`."""
