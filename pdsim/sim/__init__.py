"""The SimPy backend. Importing it registers every cost model ("roofline", "profiled")."""

from pdsim.sim import cost, profiled  # noqa: F401  (registration)
