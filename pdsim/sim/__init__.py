"""The SimPy backend. Importing it registers every cost model ("roofline", "profiled",
"silicon", "auto")."""

from pdsim.sim import cost, profiled, silicon  # noqa: F401  (registration)
